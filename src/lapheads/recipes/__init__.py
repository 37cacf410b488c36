"""Recipes: one module per experiment, all running on the shared engine (lapheads.engine).

=========  ===========================  ===============================================
recipe     module                       what it trains
=========  ===========================  ===============================================
classify   lapheads.recipes.classify    DeiT-3 supervised ViT classification
lm         lapheads.recipes.lm          NanoChat-style language-model pretraining
sft        lapheads.recipes.sft         supervised fine-tuning on chat JSONL
dino       lapheads.recipes.dino        DINO self-supervised ViT
retrofit   lapheads.recipes.retrofit    k heads of a pretrained LM switched, then trained
=========  ===========================  ===============================================

Each module exposes ``train_main(argv)`` (the CLI), ``build_task(cfg, info)`` and
``load_model(run_dir, weights="model")`` which rebuilds the trained model from ``final/``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

RECIPES = {
    "classify": "lapheads.recipes.classify",
    "lm": "lapheads.recipes.lm",
    "sft": "lapheads.recipes.sft",
    "dino": "lapheads.recipes.dino",
    "retrofit": "lapheads.recipes.retrofit",
}


def recipe_module(name: str) -> Any:
    if name not in RECIPES:
        raise CheckpointError(f"unknown recipe {name!r}; known recipes: {sorted(RECIPES)}")
    return importlib.import_module(RECIPES[name])


def run_recipe(run_dir: str | Path) -> str:
    """The recipe name recorded in ``run_dir/config.yaml``."""
    from ..engine.run import RunDir
    return RunDir(run_dir).read_config()["recipe"]


def load_run(run_dir: str | Path, weights: str = "model") -> dict[str, Any]:
    """A finished run's trained model, rebuilt from ``final/``.

    Returns ``{"recipe", "model", "kind", "tokenizer"}`` where ``kind`` is how the geometry
    toolkit reads it (``"vit"`` for classify / dino backbones, ``"hf"`` for lm / sft) and
    ``tokenizer`` is set for language models.
    """
    name = run_recipe(run_dir)
    if name == "dino":
        from .probes import load_backbone
        model, _meta = load_backbone(run=str(run_dir))
        return {"recipe": name, "model": model, "kind": "vit", "tokenizer": None}
    got = recipe_module(name).load_model(Path(run_dir), weights)
    if isinstance(got, tuple):  # lm / sft: (model, tokenizer)
        return {"recipe": name, "model": got[0], "kind": "hf", "tokenizer": got[1]}
    return {"recipe": name, "model": got, "kind": "vit", "tokenizer": None}
