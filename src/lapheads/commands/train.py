"""``lapheads train <recipe>``: parse the shared flags, load the recipe's config, train.

Every recipe shares the flags of :func:`lapheads.engine.run.add_train_args` (``--config``,
``--out``, ``--resume``, ``--overwrite``, ``--set KEY=VALUE``); the recipe's config type checks
every value before anything runs (:func:`lapheads.engine.config.load_config`).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from ..engine.config import load_config
from ..engine.run import add_train_args
from ..recipes import get_recipe
from ..recipes.shipped import resolve_config


def train(recipe_name: str, argv: Optional[Sequence[str]]) -> int:
    """``lapheads train RECIPE_NAME ARGV...``."""
    recipe = get_recipe(recipe_name)
    p = argparse.ArgumentParser(prog=f"lapheads train {recipe.name}", description=recipe.description,
                                allow_abbrev=False)
    add_train_args(p, recipe.default_config)
    args = p.parse_args(list(argv or []))
    cfg = load_config(recipe.config_type, resolve_config(recipe.name, args.config), args.overrides, recipe=recipe.name)
    result = recipe.train(cfg, args.out, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one report per job, not one per process
        for line in recipe.result_lines(result, args.out):
            print(line)
    return 0


def classify(argv: Optional[Sequence[str]] = None) -> int:
    return train("classify", argv)


def lm(argv: Optional[Sequence[str]] = None) -> int:
    return train("lm", argv)


def sft(argv: Optional[Sequence[str]] = None) -> int:
    return train("sft", argv)


def dino(argv: Optional[Sequence[str]] = None) -> int:
    return train("dino", argv)


def retrofit(argv: Optional[Sequence[str]] = None) -> int:
    return train("retrofit", argv)


def retrofit_vit(argv: Optional[Sequence[str]] = None) -> int:
    return train("retrofit_vit", argv)
