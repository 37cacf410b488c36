"""Finished runs of this project, read back through their recipes: geometry and backbones.

:func:`analyze_run` (``lapheads analyze --run DIR``) measures the token geometry of a run with the model and
held-out data its recipe gives (docs/design/recipes.md) and writes ``RUN/geometry/geometry.json``, which the
report reads; :func:`load_backbone` gives the frozen vision backbone of a run or of a timm name (probes, PCA maps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from .engine.run import RunDir
from .errors import ConfigError
from .geometry.capture import analyze_model, save_geometry_json
from .geometry.plots import plot_all
from .recipes import get_recipe, recipe_of_run
from .vision.backbones import timm_backbone

#: Default minimum tokens per next-token class for language runs (``--min-count``).
LM_MIN_COUNT = 5


def analyze_run(
    run_dir: str | Path,
    *,
    max_items: int = 512,
    batch_size: int = 64,
    layers: Optional[list] = None,
    out_dir: Optional[Path] = None,
    plots: bool = True,
    progress: bool = False,
    min_count: Optional[int] = None,
    threshold: float = 0.99,
    spectra: bool = True,
    include_prefix: bool = False,
    nc4: bool = True,
    max_batches: Optional[int] = None,
    seq_len: Optional[int] = None,
    device: Optional[str | torch.device] = None,
) -> dict[str, Any]:
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
    batch_size = max(1, min(batch_size, max_items)) if max_items and batch_size >= 1 else batch_size
    run = RunDir(run_dir)
    recipe = recipe_of_run(run.path)
    if seq_len is not None and recipe.kind == "vit":
        raise ConfigError(f"--seq-len is for language runs; {run.path} is a `{recipe.name}` run (images)")
    if include_prefix and recipe.kind == "hf":
        raise ConfigError(
            f"--include-prefix is for vision runs (CLS/register tokens); {run.path} is a `{recipe.name}` run"
        )
    counts = dict(
        max_items=max_items, batch_size=batch_size, seq_len=seq_len, min_count=min_count, max_batches=max_batches
    )
    for name, v in counts.items():
        if v is not None and v < 1:
            raise ConfigError(f"{name}={v} must be >= 1")
    if not 0 < threshold <= 1:
        raise ConfigError(f"threshold={threshold} must be in (0, 1]")
    if not (run.final_dir / "model.json").is_file():
        raise ConfigError(f"{run.path} is not finished (no final/model.json); train it to the end first")
    if min_count is None:
        min_count = LM_MIN_COUNT if recipe.kind == "hf" else 1
    dev = torch.device(device) if device is not None else torch.device("cpu")
    loaded = recipe.load_run(run.path, device=dev)
    batches = recipe.eval_batches(loaded, max_items=max_items, batch_size=batch_size, seq_len=seq_len)
    res = analyze_model(
        loaded.model,
        batches,
        kind=loaded.kind,
        layers=layers,
        min_count=min_count,
        threshold=threshold,
        spectra=spectra,
        include_prefix=include_prefix,
        nc4=nc4,
        max_batches=max_batches,
        device=dev,
        progress=progress,
        **loaded.analyze_options,
    )
    if loaded.kind == "hf":
        res["meta"]["seq_len"] = int(batches[0]["input_ids"].shape[1])
    res["meta"].update(
        run=str(run.path),
        recipe=recipe.name,
        laplacian_heads=recipe.heads(run.path),
        max_items=max_items,
        batch_size=batch_size,
        spectra=spectra,
        nc4=nc4,
    )
    out = Path(out_dir) if out_dir else run.path / "geometry"
    out.mkdir(parents=True, exist_ok=True)
    save_geometry_json(res, out / "geometry.json")
    if plots:
        plot_all({run.path.name: res}, out)
    return res


def load_geometry(run_dir: str | Path) -> Optional[dict[str, Any]]:
    return RunDir(run_dir).read_json("geometry/geometry.json", "the geometry of a run", missing=None)


def load_backbone(
    run: Optional[str | Path] = None,
    model: Optional[str] = None,
    weights: Optional[str] = None,
    laplacian_heads: Any = None,
    img_size: Optional[int] = None,
    device: str | torch.device = "cpu",
    **timm_kwargs: Any,
) -> tuple[torch.nn.Module, dict]:
    """A frozen vision backbone and its metadata, from a finished run (``run``: its recipe's
    ``load_backbone``; a language run is refused) or from a timm name (``model``, optionally
    ``weights``, ``laplacian_heads``, ``img_size`` and more timm kwargs).

    Raises:
        ConfigError: neither or both of ``run`` and ``model``.
        CheckpointError: ``run`` is not a finished run of a vision recipe.
    """
    if (run is None) == (model is None):
        raise ConfigError("give exactly one of --run DIR or --model NAME")
    if model is not None:
        return timm_backbone(
            model, weights=weights, laplacian_heads=laplacian_heads, img_size=img_size, device=device, **timm_kwargs
        )
    path = Path(run)
    if not RunDir(path).exists():
        # an exported backbone directory (final/model.json in DINO's layout, with its weights) is read as
        # a DINO run's; the DINO loader says what is missing otherwise
        return get_recipe("dino").load_backbone(path, device=device)
    return recipe_of_run(path).load_backbone(path, device=device)
