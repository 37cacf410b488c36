"""``lapheads report``: Markdown + HTML report comparing runs (analysing the runs that lack geometry)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from ..engine.config import number_arg
from ..engine.run import lock_dir, lock_enclosing_run  # one writer per run directory
from ..errors import ConfigError
from ..outputs import check_out_dir, removed_on_failure
from ..report import build_report
from ..runs import analyze_run


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads report", description="Markdown + HTML report comparing runs, grouped by Laplacian heads."
    )
    p.add_argument("runs", nargs="+", help="run directories (finished `lapheads train ...` runs)")
    p.add_argument("--out", default="report", help="output directory (report.md, report.html, figures/)")
    p.add_argument("--title", default="lapheads report")
    p.add_argument("--analyze", action="store_true", help="run the geometry analysis of runs that have none yet")
    p.add_argument(
        "--plateau-window",
        type=number_arg(float, gt=0.0, le=1.0),
        default=0.2,
        help="fraction of training at the end over which a run's plateau flag measures the change "
        "of its validation metric (default 0.2)",
    )
    p.add_argument(
        "--plateau-tol",
        type=number_arg(float, ge=0.0),
        default=0.01,
        help="largest relative change of the validation metric over that window that counts as "
        "a plateau (default 0.01 = 1%%)",
    )
    args = p.parse_args(list(argv or []))
    check_out_dir(args.out)
    dirs = [Path(d) for d in args.runs]
    for d in dirs:
        if not (d / "config.yaml").is_file():
            raise ConfigError(f"{d} is not a run directory (no config.yaml)")
    if args.analyze:
        for d in dirs:
            if not (d / "geometry" / "geometry.json").is_file() and (d / "final" / "model.json").is_file():
                with lock_dir(d):
                    analyze_run(d)
    with lock_enclosing_run(args.out), removed_on_failure(args.out):  # a failed report leaves no figures behind
        paths = build_report(
            dirs, args.out, title=args.title, plateau_window=args.plateau_window, plateau_tol=args.plateau_tol
        )
    print(f"report: {paths['md']}\n        {paths['html']}")
    return 0
