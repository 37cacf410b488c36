"""Geometry of a finished run of this project (``lapheads analyze --run DIR``).

The run's own recipe says what the model is and which held-out data to measure on:

* ``classify``: the classifier on the validation split of ``data.train`` (or ``data.val``),
  with the run's evaluation transform; a sequence is an image, its class the image label, and the
  model's head gives NC3/NC4 at ``pre_logits``.
* ``dino``: the teacher backbone on the validation split of the run's data; the labels are used
  only for measuring (DINO never saw them).
* ``lm`` / ``sft``: the transformers model from ``final/hf`` on the run's validation token shards;
  a sequence is a window, the class of a token is its next token (linguistic collapse).

Results go to ``RUN/geometry/geometry.json`` (and figures next to it); the report reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import ConfigError


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


def analyze_run(run_dir: str | Path, *, max_items: int = 512, batch_size: int = 64,
                layers: Optional[list] = None, out_dir: Optional[Path] = None, plots: bool = True,
                progress: bool = False) -> dict[str, Any]:
    """Measure the token geometry of a finished run and write ``geometry/geometry.json``.

    Args:
        run_dir: a finished run directory (``final/`` present).
        max_items: images (vision) or token windows (language) to measure on.
        batch_size: images / windows per forward pass.
        layers: layer selection passed to :func:`lapheads.geometry.analyze_model` (default all).
        out_dir: where to write (default ``RUN/geometry``).
        plots: also write the per-run figures.
    """
    from ..engine.config import from_dict
    from ..engine.run import RunDir
    from .capture import analyze_model, save_geometry_json

    batch_size = max(1, min(batch_size, max_items)) if max_items else batch_size
    run = RunDir(run_dir)
    raw = run.read_config()
    recipe = raw.pop("recipe")
    if not (run.final_dir / "model.json").is_file():
        raise ConfigError(f"{run.path} is not finished (no final/model.json); train it to the end first")
    if recipe == "classify":
        from ..data.images import build_image_dataset
        from ..data.transforms import build_transforms
        from ..recipes.classify import ClassifyConfig, load_model
        cfg = from_dict(ClassifyConfig, raw)
        model = load_model(run.path)
        ds = build_image_dataset(cfg.data.val or cfg.data.train, split="val")
        tf = build_transforms(cfg.model.img_size, train=False, mean=cfg.data.mean, std=cfg.data.std,
                              in_chans=int(cfg.model.extra.get("in_chans", 3)))
        res = analyze_model(model, _vision_batches(ds, tf, batch_size, max_items), kind="vit", layers=layers,
                            progress=progress)
    elif recipe == "dino":
        from ..data.images import build_image_dataset
        from ..recipes.probes import load_backbone, eval_transform
        backbone, meta = load_backbone(run=str(run.path))
        ds = build_image_dataset(raw["data"]["train"], split="val")
        tf = eval_transform(meta)
        res = analyze_model(backbone, _vision_batches(ds, tf, batch_size, max_items), kind="vit",
                            layers=layers, classifier=None, progress=progress)
    elif recipe in ("lm", "sft"):
        from ..data.text import TokenShards
        from ..recipes.lm import LMConfig, load_model, prepare_data
        model, _tok = load_model(run.path)
        if recipe == "lm":
            cfg = from_dict(LMConfig, raw)
            _, shard_dir = prepare_data(cfg.data)
            seq_len = cfg.data.seq_len
        else:  # SFT: measure on the validation text of the pretraining run it started from
            base = RunDir(raw["init_from"]).read_config()
            base.pop("recipe")
            cfg = from_dict(LMConfig, base)
            _, shard_dir = prepare_data(cfg.data)
            seq_len = cfg.data.seq_len
        val = TokenShards(shard_dir, "val")
        n_batches = max(1, max_items // batch_size)
        batches = [{"input_ids": x, "attention_mask": torch.ones_like(x)}
                   for x, _y in val.iter_batches(batch_size, seq_len, max_batches=n_batches)]
        res = analyze_model(model, batches, kind="hf", layers=layers, num_classes=model.config.vocab_size,
                            progress=progress)
    else:
        raise ConfigError(f"{run.path}: geometry analysis does not know recipe {recipe!r}")
    res["meta"]["run"] = str(run.path)
    res["meta"]["recipe"] = recipe
    res["meta"]["laplacian_heads"] = getattr(model, "config", None) and getattr(model.config, "laplacian_heads", None) \
        if recipe in ("lm", "sft") else raw.get("model", {}).get("laplacian_heads")
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
