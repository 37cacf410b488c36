"""Geometry of a finished run of this project (``lapheads analyze --run DIR``).

The run's own recipe says what the model is and which held-out data to measure on:

* ``classify``: the classifier on the validation split of ``data.train`` (or ``data.val``),
  with the run's evaluation transform; a sequence is an image, its class the image label, and the
  model's head gives NC3/NC4 at ``pre_logits``.
* ``dino``: the teacher backbone (:func:`lapheads.recipes.probes.load_backbone`) on
  ``data.val_split`` of ``data.val`` (or ``data.train``), resized and normalised as the probes do;
  the labels are used only for measuring (DINO never saw them) and there is no classifier.
* ``lm`` / ``sft``: the transformers model from ``final/hf`` on validation token shards (an SFT
  run measures on those of the pretraining run it started from); a sequence is a window, the
  class of a token is its next token (linguistic collapse).

Every measurement setting of :func:`lapheads.geometry.analyze_model` can be given and is recorded
in the result's ``meta``. ``min_count`` defaults per recipe: 1 for images (a class is an image
label: every token of every image of the class counts) and :data:`LM_MIN_COUNT` for language
runs, whose next-token classes are mostly rare and whose CDNV / NC1 over classes seen once or
twice measure noise (the README recommends 5-20). Settings that a recipe cannot use
(``seq_len`` for images, ``include_prefix`` for text) are refused, not ignored.

Results go to ``RUN/geometry/geometry.json`` (and figures next to it); the report reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import ConfigError

#: Default minimum tokens per next-token class for language runs (``--min-count``).
LM_MIN_COUNT = 5
VISION_RECIPES = ("classify", "dino")
LANGUAGE_RECIPES = ("lm", "sft")


def _vision_batches(dataset: Any, transform: Any, batch_size: int, max_items: int) -> list:
    n = min(len(dataset), max_items) if max_items else len(dataset)
    # a fixed, class-balanced-ish subset: the first n items of a seeded permutation
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:n].tolist()
    batches = []
    for s in range(0, n, batch_size):
        items = [dataset[i] for i in order[s:s + batch_size]]
        batches.append((torch.stack([transform(img) for img, _ in items]),
                        torch.as_tensor([y for _, y in items], dtype=torch.long)))
    return batches


def _check_settings(recipe: str, run: Path, *, seq_len: Optional[int], include_prefix: bool,
                    min_count: Optional[int], threshold: float, max_items: int, batch_size: int,
                    max_batches: Optional[int]) -> None:
    if recipe not in VISION_RECIPES + LANGUAGE_RECIPES:
        raise ConfigError(f"{run}: geometry analysis does not know recipe {recipe!r}")
    if seq_len is not None and recipe in VISION_RECIPES:
        raise ConfigError(f"--seq-len is for language runs; {run} is a `{recipe}` run (images)")
    if include_prefix and recipe in LANGUAGE_RECIPES:
        raise ConfigError(f"--include-prefix is for vision runs (CLS/register tokens); {run} is a `{recipe}` run")
    for name, v in (("max_items", max_items), ("batch_size", batch_size), ("seq_len", seq_len),
                    ("min_count", min_count), ("max_batches", max_batches)):
        if v is not None and v < 1:
            raise ConfigError(f"{name}={v} must be >= 1")
    if not 0 < threshold <= 1:
        raise ConfigError(f"threshold={threshold} must be in (0, 1]")


def analyze_run(run_dir: str | Path, *, max_items: int = 512, batch_size: int = 64,
                layers: Optional[list] = None, out_dir: Optional[Path] = None, plots: bool = True,
                progress: bool = False, min_count: Optional[int] = None, threshold: float = 0.99,
                spectra: bool = True, include_prefix: bool = False, nc4: bool = True,
                max_batches: Optional[int] = None, seq_len: Optional[int] = None,
                device: Optional[str | torch.device] = None) -> dict[str, Any]:
    """Measure the token geometry of a finished run and write ``geometry/geometry.json``.

    Args:
        run_dir: a finished run directory (``final/`` present) of any recipe.
        max_items: images (vision) or token windows (language) to measure on.
        batch_size: images / windows per forward pass.
        layers: layer selection passed to :func:`lapheads.geometry.analyze_model` (default all).
        out_dir: where to write (default ``RUN/geometry``).
        plots: also write the per-run figures.
        progress: show a progress bar.
        min_count: minimum tokens per class for the class-mean measures (default: 1 for vision
            runs, :data:`LM_MIN_COUNT` for language runs).
        threshold: variance fraction for k (0.99 = k99).
        spectra: compute the per-sequence spectra.
        include_prefix: vision: count CLS / register tokens as tokens.
        nc4: run the second pass for NC4 (when the model has a classifier).
        max_batches: stop after this many batches (on top of ``max_items``).
        seq_len: language: tokens per window (default the run's ``data.seq_len``; at most the
            model's ``max_position_embeddings``).
        device: where the model runs (default the CPU).

    Raises:
        ConfigError: an unfinished run, an unknown recipe, or a setting this recipe cannot use.
    """
    from ..engine.config import from_dict
    from ..engine.run import RunDir
    from .capture import analyze_model, save_geometry_json

    batch_size = max(1, min(batch_size, max_items)) if max_items and batch_size >= 1 else batch_size
    run = RunDir(run_dir)
    raw = run.read_config()
    recipe = raw.pop("recipe")
    _check_settings(recipe, run.path, seq_len=seq_len, include_prefix=include_prefix, min_count=min_count,
                    threshold=threshold, max_items=max_items, batch_size=batch_size, max_batches=max_batches)
    if not (run.final_dir / "model.json").is_file():
        raise ConfigError(f"{run.path} is not finished (no final/model.json); train it to the end first")
    if min_count is None:
        min_count = LM_MIN_COUNT if recipe in LANGUAGE_RECIPES else 1
    dev = torch.device(device) if device is not None else torch.device("cpu")
    common = dict(layers=layers, min_count=min_count, threshold=threshold, spectra=spectra,
                  include_prefix=include_prefix, nc4=nc4, max_batches=max_batches, device=dev, progress=progress)
    if recipe == "classify":
        from ..data.images import build_image_dataset
        from ..data.transforms import build_transforms
        from ..recipes.classify import ClassifyConfig, in_chans_of, load_model
        cfg = from_dict(ClassifyConfig, raw)
        model = load_model(run.path).to(dev)
        ds = build_image_dataset(cfg.data.val or cfg.data.train, split="val")
        tf = build_transforms(cfg.model.img_size, train=False, mean=cfg.data.mean, std=cfg.data.std,
                              in_chans=in_chans_of(cfg.model))
        res = analyze_model(model, _vision_batches(ds, tf, batch_size, max_items), kind="vit", **common)
        heads = raw.get("model", {}).get("laplacian_heads")
    elif recipe == "dino":
        from ..data.images import build_image_dataset
        from ..recipes.dino import DinoConfig, EvalTransform
        from ..recipes.probes import load_backbone
        cfg = from_dict(DinoConfig, raw)
        model, meta = load_backbone(run=str(run.path), device=dev)
        ds = build_image_dataset(cfg.data.val or cfg.data.train, split=cfg.data.val_split)
        tf = EvalTransform(meta["img_size"], meta["mean"], meta["std"])
        res = analyze_model(model, _vision_batches(ds, tf, batch_size, max_items), kind="vit",
                            classifier=None, **common)
        heads = meta.get("laplacian_heads")
    else:
        from ..data.text import TokenShards
        from ..recipes.lm import LMConfig, load_model, prepare_data
        model, _tok = load_model(run.path, device=dev)
        # SFT: measure on the validation text of the pretraining run it started from
        base = raw if recipe == "lm" else RunDir(raw["init_from"]).read_config()
        base.pop("recipe", None)
        cfg = from_dict(LMConfig, base)
        _, shard_dir = prepare_data(cfg.data)
        length = seq_len or cfg.data.seq_len
        max_pos = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        if max_pos and length > max_pos:
            raise ConfigError(f"--seq-len {length} is longer than the model's {max_pos} positions")
        val = TokenShards(shard_dir, "val")
        n_batches = max(1, max_items // batch_size)
        batches = [{"input_ids": x, "attention_mask": torch.ones_like(x)}
                   for x, _y in val.iter_batches(batch_size, length, max_batches=n_batches)]
        res = analyze_model(model, batches, kind="hf", num_classes=model.config.vocab_size, **common)
        res["meta"]["seq_len"] = length
        heads = getattr(model.config, "laplacian_heads", None)
    res["meta"].update({"run": str(run.path), "recipe": recipe, "laplacian_heads": heads, "max_items": max_items,
                        "batch_size": batch_size, "spectra": spectra, "nc4": nc4})
    out = Path(out_dir) if out_dir else run.path / "geometry"
    out.mkdir(parents=True, exist_ok=True)
    save_geometry_json(res, out / "geometry.json")
    if plots:
        from .plots import plot_all
        plot_all({run.path.name: res}, out)
    return res


def load_geometry(run_dir: str | Path) -> Optional[dict[str, Any]]:
    p = Path(run_dir) / "geometry" / "geometry.json"
    return json.loads(p.read_text()) if p.is_file() else None
