"""``lapheads quickstart``: baseline vs Laplacian heads on embedded data, trained, analysed and reported."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

from tqdm.auto import tqdm

from ..engine.run import lock_dir
from ..engine.threads import available_cpus
from ..errors import ConfigError
from ..quickstart import PLAN, SCOPE
from ..recipes.shipped import CONFIG_DIR
from ..report import build_report
from ..runs import analyze_run
from ..sweep import check_plan, delete_runs, plan_grid, run_grid


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads quickstart",
        allow_abbrev=False,
        description="Train baseline and Laplacian-head models on embedded data (digits images and "
        "Python's pydoc text), measure their token geometry and write a report.",
    )
    p.add_argument("--out", default="runs/quickstart", help="output directory (resumable)")
    p.add_argument("--tiny", action="store_true", help="a few steps per run (pipeline check, < 1 minute)")
    p.add_argument(
        "--overwrite", action="store_true", help="train every run afresh (deletes those runs, nothing else in --out)"
    )
    p.add_argument("--no-lm", action="store_true", help="skip the language-model part")
    p.add_argument("--no-vision", action="store_true", help="skip the vision part")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(available_cpus(), 4),
        help="runs trained at once, each in its own process (default: one per core, up to 4; "
        "1 = one at a time in this process)",
    )
    args = p.parse_args(list(argv or []))
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: expected a positive number of runs at once")
    plan = PLAN["tiny" if args.tiny else "full"]
    with lock_dir(args.out):
        return _run(args, plan, CONFIG_DIR, Path(args.out))


def _run(args: argparse.Namespace, plan: dict, rdir: Path, out: Path) -> int:
    t0 = time.time()
    parts = []
    if not args.no_vision:
        cfg = rdir / "classify" / "digits.yaml"
        parts.append(("vision", "classify", cfg, plan["vision_heads"], plan["vision_seeds"], plan["vision_set"]))
    if not args.no_lm:
        cfg = rdir / "lm" / "tiny.yaml"
        parts.append(("lm", "lm", cfg, plan["lm_heads"], plan["lm_seeds"], plan["lm_set"]))
    if not parts:
        raise ConfigError("--no-lm and --no-vision leave nothing to run")
    hint = f"pass --overwrite to start {out} afresh, or choose another --out"
    restart = []  # every part is checked, and --overwrite deletes its runs, before the first one trains
    for name, recipe, cfg, heads, seeds, overrides in parts:
        grid = plan_grid(recipe, str(cfg), heads, seeds, out / name, overrides)
        restart += check_plan(grid, out / name, str(cfg), overwrite=args.overwrite, hint=hint)
    delete_runs(restart)
    dirs: list[Path] = []
    for name, recipe, cfg, heads, seeds, overrides in parts:
        print(
            f"[quickstart] {name}: {recipe} with Laplacian heads {', '.join(heads)} x seeds "
            f"{', '.join(map(str, seeds))}  ({cfg.relative_to(rdir.parent)})",
            flush=True,
        )
        dirs += run_grid(recipe, str(cfg), heads, seeds, out / name, overrides, hint=hint, jobs=args.jobs)
    print("[quickstart] token geometry of every run", flush=True)
    for d in tqdm(dirs, desc="analyze", unit="run", disable=None):  # None: a bar only on a terminal
        if not (d / "geometry" / "geometry.json").is_file():
            with lock_dir(d):
                analyze_run(d, max_items=plan["max_items"], plots=False)
    intro = (
        "Baseline (k=0) against Laplacian heads on embedded data: a tiny ViT on scikit-learn's "
        "digits and a tiny NanoChat-style LM on Python's pydoc topics (k = 0 and all heads of every "
        "layer Laplacian), trained on a CPU.\n\n"
        + SCOPE
        + ("\n\nThis is a --tiny run (a few steps per model): its numbers mean nothing." if args.tiny else "")
    )
    paths = build_report(dirs, out / "report", title="lapheads quickstart", intro=intro)
    print(f"[quickstart] done in {time.time() - t0:.0f} s")
    print(f"[quickstart] report: {paths['md']}")
    print(f"[quickstart]         {paths['html']}")
    return 0
