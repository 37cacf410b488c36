"""``lapheads analyze``: token geometry of timm / transformers checkpoints, with figures.

Writes ``OUT/geometry.json`` (``{"runs": {label: analyze_model result}, "figures": [...]}``) and the
PNG figures of :mod:`lapheads.geometry.plots` (several checkpoints share each figure). Examples:
``docs/geometry.md``; design notes: ``docs/design/lm.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import torch

from ..engine.config import load_yaml
from ..engine.pretrained import load_checkpoint
from ..engine.run import lock_dir, lock_enclosing_run
from ..errors import ConfigError
from ..geometry.batches import build_batches
from ..geometry.capture import analyze_model, resolve_layers, save_geometry_json
from ..geometry.plots import plot_all
from ..outputs import check_out_dir
from ..recipes import load_run
from ..runs import analyze_run
from . import opts, repeated

__all__ = ["main"]


def _parse_kv(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items or []:
        if "=" not in it:
            raise ConfigError(f"--model-args expects key=value, got {it!r}")
        k, v = it.split("=", 1)
        out[k] = load_yaml(v, f"--model-args {it!r}")
    return out


def _parse_layers(s: Optional[str]) -> Optional[list[Any]]:
    if s is None or s.strip() in ("", "all"):
        return None
    out: list[Any] = []
    for tok in s.split(","):
        tok = tok.strip()
        try:
            out.append(int(tok))
        except ValueError:
            out.append(tok)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lapheads analyze",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    repeated(ap, "--checkpoint", "transformers checkpoint directory or timm model name; repeat to compare runs")
    repeated(ap, "--label", "name of each --checkpoint in the figures (default: the checkpoint's name)")
    repeated(ap, "--weights", "state dict (.safetensors/.pt) for the timm --checkpoint of the same position")
    ap.add_argument(
        "--model-args",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="timm.create_model keyword arguments, e.g. img_size=32 patch_size=8 depth=2",
    )
    repeated(
        ap,
        "--run",
        "a run directory trained by this project; without --data it is measured on its "
        "own held-out data and the result also goes to RUN/geometry/",
    )
    ap.add_argument(
        "--data",
        help="images: 'digits' or an ImageFolder directory; text: 'pydoc' or a .txt file (required with --checkpoint)",
    )
    ap.add_argument(
        "--max-items", type=int, help="--run without --data: images / token windows to measure on (default 512)"
    )
    ap.add_argument(
        "--layers",
        help="comma list: vit block indices and/or 'pre_logits'; hf hidden-state indices (0 = embeddings); default all",
    )
    ap.add_argument("--max-batches", type=int, help="stop after this many batches")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument(
        "--seq-len",
        type=int,
        help="text: tokens per sequence (default 128; --run without --data: the run's data.seq_len)",
    )
    ap.add_argument("--image-size", type=int, help="images: default the model's input size")
    ap.add_argument(
        "--min-count",
        type=int,
        help="minimum tokens per class for NC measures (use 5-20 for next-token classes; default 1, "
        "and 5 for lm/sft runs without --data)",
    )
    ap.add_argument("--threshold", type=float, default=0.99, help="variance fraction for k (0.99 = k99)")
    ap.add_argument("--no-spectra", action="store_true", help="skip per-sequence eigen-decompositions (faster)")
    ap.add_argument("--include-prefix", action="store_true", help="vit: count CLS/register tokens as tokens")
    ap.add_argument("--no-nc4", action="store_true", help="skip the second pass for NC4")
    ap.add_argument("--no-figures", action="store_true", help="write geometry.json only")
    ap.add_argument("--device", help="device for the model (default cuda if available; --run without --data: cpu)")
    ap.add_argument("--out", required=True, help="output directory for geometry.json and figures")
    return ap


def _main_runs(args: argparse.Namespace, layers: Optional[list]) -> int:
    """``--run`` without ``--data``: each run on its own held-out data (lapheads.runs.analyze_run)."""
    for r in args.run:
        if not (Path(r) / "config.yaml").is_file():
            raise ConfigError(f"--run {r} is not a run directory (no config.yaml)")
    for flag, given in (
        ("--weights", args.weights),
        ("--model-args", args.model_args),
        ("--image-size", args.image_size is not None),
    ):
        if given:
            raise ConfigError(
                f"{flag} is for --checkpoint (or --run with --data); a run without --data is measured as it was trained"
            )
    labels = args.label or [Path(r).name for r in args.run]
    if len(set(labels)) != len(labels):
        raise ConfigError("two runs have the same label; give distinct --label values")
    settings = dict(
        max_items=512 if args.max_items is None else args.max_items,
        layers=layers,
        **opts(args, "batch_size seq_len device"),
        plots=not args.no_figures,
        **_measures(args),
    )
    runs = {}
    for lb, r in zip(labels, args.run):
        with lock_dir(r):
            runs[lb] = analyze_run(r, **settings)
        m = runs[lb]["meta"]
        print(
            f"{lb}: {m['recipe']} run, {m['n_tokens']} tokens, min_count {m['min_count']}"
            + "".join(f"\n  note: {n}" for n in m["notes"])
        )
    return _write_results(runs, args)


def _measures(args: argparse.Namespace) -> dict[str, Any]:
    """The measurement settings shared by analyze_run and analyze_model."""
    return dict(
        **opts(args, "min_count threshold include_prefix max_batches"), spectra=not args.no_spectra, nc4=not args.no_nc4
    )


def _write_results(runs: dict[str, Any], args: argparse.Namespace) -> int:
    """Figures and geometry.json into ``--out`` (under the lock of the run it lies in, if any)."""
    out = Path(args.out)
    with lock_enclosing_run(out):
        figs = [] if args.no_figures else plot_all(runs, out)
        path = save_geometry_json({"runs": runs, "figures": [str(f.name) for f in figs]}, out / "geometry.json")
    _print_layers(runs, args.threshold)
    print(f"wrote {path} and {len(figs)} figures to {out}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``lapheads analyze``."""
    args = _parser().parse_args(argv)
    check_out_dir(args.out)
    sources = [("checkpoint", c) for c in args.checkpoint] + [("run", r) for r in args.run]
    if not sources:
        raise ConfigError("give at least one --checkpoint (or --run)")
    if args.label and len(args.label) != len(sources):
        raise ConfigError(
            f"{len(args.label)} --label for {len(sources)} checkpoints/runs: give one per checkpoint or none"
        )
    if len(args.weights) > len(args.checkpoint):
        raise ConfigError("more --weights than --checkpoint")
    for name in ("batch_size", "seq_len", "min_count", "max_items", "max_batches"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not 0 < args.threshold <= 1:
        raise ConfigError(f"--threshold must be in (0, 1], got {args.threshold}")
    layers = _parse_layers(args.layers)
    if args.data is None:
        if args.checkpoint:
            raise ConfigError("--data is required with --checkpoint (e.g. --data digits or --data pydoc)")
        return _main_runs(args, layers)
    if args.max_items is not None:
        raise ConfigError("--max-items is for --run without --data; with --data use --max-batches")
    args.seq_len = args.seq_len or 128  # 0 was refused above
    args.min_count = args.min_count or 1
    model_args = _parse_kv(args.model_args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    labels = args.label or []

    # load (and validate) every model before the first expensive pass
    loaded = []
    for i, (what, spec) in enumerate(sources):
        if what == "checkpoint":
            w = args.weights[i] if i < len(args.weights) else None
            model, kind, tok = load_checkpoint(spec, w, model_args)
        else:
            got = load_run(spec)
            model, kind, tok = got.model, got.kind, got.tokenizer
        label = labels[i] if labels else Path(spec).name or spec
        batches = build_batches(
            model, kind, tok, args.data, args.batch_size, args.seq_len, args.image_size, args.max_batches
        )
        resolve_layers(model, kind, layers)
        loaded.append((label, model, kind, batches))
    if len({l for l, *_ in loaded}) != len(loaded):
        raise ConfigError("two runs have the same label; give distinct --label values")
    runs: dict[str, Any] = {}
    for label, model, kind, batches in loaded:
        model.to(device)
        runs[label] = analyze_model(model, batches, kind, layers, device=device, progress=False, **_measures(args))
        model.to("cpu")
        m = runs[label]["meta"]
        print(
            f"{label}: {m['n_batches']} batches, {m['n_tokens']} tokens, {len(m['layers'])} layers "
            f"in {m['seconds']:.1f}s" + "".join(f"\n  note: {n}" for n in m["notes"])
        )
    return _write_results(runs, args)


def _print_layers(runs: dict[str, Any], threshold: float) -> None:
    """One summary line per run and layer."""
    shown = [  # (section of a layer's result, key it needs, text)
        ("anova", "frac_within_sequence", "within-seq {frac_within_sequence:.3f}"),
        ("spectra", "k_mean", f"k{round(100 * threshold)} {{k_mean:.1f}}"),
        ("cosine", "cosine_mean", "cos {cosine_mean:.3f}"),
        ("nc_tokens", "nc1", "NC1 {nc1:.3g} CDNV {cdnv:.3g}"),
    ]
    for label, res in runs.items():
        for lname, r in res["layers"].items():
            parts = [text.format(**r[sec]) for sec, key, text in shown if key in r.get(sec, {})]
            print("  " + " ".join([f"{label} {lname}:", *parts]))
