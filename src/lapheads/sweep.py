"""``lapheads sweep``: one recipe over a grid of Laplacian-head settings and seeds, then a report.

::

    lapheads sweep --config recipes/classify/digits.yaml --laplacian-heads 0,2,all --seeds 0,1,2 \\
        --out runs/digits_sweep [--set data.epochs=5] [--analyze]

Every grid point is an ordinary run directory ``OUT/lap<k>_seed<s>`` made by the recipe's own
``lapheads train`` command (same flags, same layout). The sweep is resumable: a finished run
(``final/model.json`` exists) is skipped, an interrupted one continues with ``--resume`` from its
newest checkpoint, a missing one starts. Afterwards every run can be analysed (``--analyze``) and
``OUT/report/`` gets the comparison report (``lapheads report``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from .engine.config import read_yaml
from .errors import ConfigError
from .heads import LaplacianHeads


def run_name(k: str, seed: int) -> str:
    return f"lap{k}_seed{seed}"


def parse_heads_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--laplacian-heads {text!r} is empty; give e.g. 0,3,all")
    for t in items:
        LaplacianHeads(t)  # validates (int >= 0, all, none)
    return items


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r} must be comma-separated integers, e.g. 0,1,2") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    return seeds


def run_state(run_dir: Path) -> str:
    """``done`` (final model written), ``partial`` (started, resumable) or ``new``."""
    if (run_dir / "final" / "model.json").is_file():
        return "done"
    if (run_dir / "config.yaml").is_file():
        return "partial"
    return "new"


def run_grid(recipe: str, config: Optional[str], heads: Sequence[str], seeds: Sequence[int], out: Path,
             overrides: Sequence[str] = (), quiet: bool = False) -> list[Path]:
    """Train every (k, seed) point that is not finished yet; returns the run directories."""
    from .recipes import recipe_module
    mod = recipe_module(recipe)
    dirs = []
    for k in heads:
        for seed in seeds:
            d = out / run_name(k, seed)
            dirs.append(d)
            state = run_state(d)
            if state == "done":
                if not quiet:
                    print(f"[sweep] {d.name}: finished, skipped")
                continue
            argv = ["--out", str(d), "--set", f"model.laplacian_heads={k}", "--set", f"train.seed={seed}"]
            if config:
                argv = ["--config", config] + argv
            for o in overrides:
                argv += ["--set", o]
            if state == "partial":
                argv.append("--resume")
            if not quiet:
                print(f"[sweep] {d.name}: {'resuming' if state == 'partial' else 'training'}")
            mod.train_main(argv)
    return dirs


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads sweep",
        description="Run a recipe for several Laplacian-head settings and seeds (resumable), then "
                    "write a report comparing them.")
    p.add_argument("--config", required=True, help="recipe YAML (its top-level `recipe:` names the recipe)")
    p.add_argument("--recipe", default=None, help="recipe name when the YAML does not say it")
    p.add_argument("--laplacian-heads", default="0,all",
                   help="comma-separated settings of model.laplacian_heads, e.g. 0,3,6 or 0,all")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--out", required=True, help="sweep directory (one run directory per grid point)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override applied to every run (repeatable)")
    p.add_argument("--analyze", action="store_true", help="run the geometry analysis of every run")
    p.add_argument("--no-report", action="store_true", help="skip the report")
    args = p.parse_args(list(argv or []))
    heads, seeds = parse_heads_list(args.laplacian_heads), parse_seeds(args.seeds)
    recipe = read_yaml(args.config).get("recipe") or args.recipe
    if not recipe:
        raise ConfigError(f"{args.config} has no top-level `recipe:`; pass --recipe classify|lm|sft|dino")
    if args.recipe and recipe != args.recipe:
        raise ConfigError(f"{args.config} is a {recipe!r} recipe but --recipe says {args.recipe!r}")
    out = Path(args.out)
    dirs = run_grid(recipe, args.config, heads, seeds, out, args.overrides)
    if args.analyze:
        from .geometry.runs import analyze_run
        for d in dirs:
            analyze_run(d)
    if not args.no_report:
        from .report import build_report
        paths = build_report(dirs, out / "report", title=f"Sweep: {Path(args.config).name}")
        print(f"report: {paths['html']}")
    return 0
