"""``lapheads sweep``: a recipe over Laplacian-head settings, seeds and config axes, resumably, then a report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from ..engine.config import read_yaml
from ..recipes.shipped import resolve_any
from ..engine.run import lock_dir
from ..errors import ConfigError
from ..report import build_report
from ..runs import analyze_run
from ..sweep import design_points, parse_grid, parse_heads_list, parse_point, parse_seeds, run_grid


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads sweep", allow_abbrev=False,
        description="Run a recipe for several Laplacian-head settings and seeds, optionally crossed with "
                    "config axes (--grid, --point), resumably; then write a report comparing them.")
    p.add_argument("--config", required=True, help="recipe YAML (its top-level `recipe:` names the recipe)")
    p.add_argument("--recipe", default=None, help="recipe name when the YAML does not say it")
    p.add_argument("--laplacian-heads", default="0,all",
                   help="comma-separated settings of model.laplacian_heads, e.g. 0,3,6 or 0,all")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a config axis crossed with every other --grid, k and seed (repeatable), "
                        "e.g. model.embed_dim=64,128")
    p.add_argument("--point", action="append", default=[], metavar="KEY=V,KEY2=V2",
                   help="one explicit design point (repeatable), for uneven designs, e.g. "
                        "model.embed_dim=128,train.max_steps=400")
    p.add_argument("--out", required=True, help="sweep directory (one run directory per grid point)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override applied to every run (repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete every existing run of the grid first and train them all afresh")
    p.add_argument("--restart-changed", action="store_true",
                   help="train afresh the existing runs whose config differs from this command's "
                        "(default: stop and list them)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once, each in its own process with the cores shared out "
                        "(default 1: one run at a time, in this process)")
    p.add_argument("--analyze", action="store_true", help="run the geometry analysis of every run")
    p.add_argument("--no-report", action="store_true", help="skip the report")
    args = p.parse_args(list(argv or []))
    heads, seeds = parse_heads_list(args.laplacian_heads), parse_seeds(args.seeds)
    design = design_points(parse_grid(args.grid, args.overrides),
                           [parse_point(x, args.overrides) for x in args.point])
    args.config = resolve_any(args.config, args.recipe)  # a path, or a shipped config's name
    recipe = read_yaml(args.config).get("recipe") or args.recipe
    if not recipe:
        raise ConfigError(f"{args.config} has no top-level `recipe:`; pass --recipe classify|lm|sft|dino")
    if args.recipe and recipe != args.recipe:
        raise ConfigError(f"{args.config} is a {recipe!r} recipe but --recipe says {args.recipe!r}")
    out = Path(args.out)
    with lock_dir(out):
        dirs = run_grid(recipe, args.config, heads, seeds, out, args.overrides, overwrite=args.overwrite,
                        restart_changed=args.restart_changed, design=design, jobs=args.jobs)
        if args.analyze:
            for d in dirs:
                with lock_dir(d):
                    analyze_run(d)
        if not args.no_report:
            paths = build_report(dirs, out / "report", title=f"Sweep: {Path(args.config).name}")
            print(f"report: {paths['html']}")
    return 0
