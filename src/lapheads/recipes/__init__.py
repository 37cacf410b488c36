"""Recipes: one module per training task (classify, lm, sft, dino, retrofit, retrofit_vit), all on the
shared engine (:mod:`lapheads.engine`).

Each module defines ``RECIPE``, an instance of a :class:`~lapheads.recipes.base.Recipe` subclass (docs/design/recipes.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..engine.run import RunDir
from ..errors import CheckpointError
from .base import LoadedRun, Metric, Recipe

__all__ = ["RECIPES", "get_recipe", "recipe_of_run", "load_run", "Recipe", "LoadedRun", "Metric"]

#: recipe name -> the module that defines its ``RECIPE``
RECIPES = {name: f"lapheads.recipes.{name}" for name in ("classify", "lm", "sft", "dino", "retrofit", "retrofit_vit")}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``. Its module is imported here, on demand: a vision command never
    pays for the language stack (tokenizers, transformers) and vice versa."""
    if name not in RECIPES:
        raise CheckpointError(f"unknown recipe {name!r}; known recipes: {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[name]).RECIPE


def recipe_of_run(run_dir: str | Path) -> Recipe:
    """The recipe that made ``run_dir`` (the ``recipe`` field of its ``config.yaml``)."""
    return get_recipe(RunDir(run_dir).read_config()["recipe"])


def load_run(run_dir: str | Path, weights: str = "model", device: str = "cpu") -> LoadedRun:
    """A finished run's trained model and what feeds it (see :class:`LoadedRun`)."""
    return recipe_of_run(run_dir).load_run(run_dir, weights=weights, device=device)
