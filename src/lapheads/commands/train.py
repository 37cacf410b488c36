"""``lapheads train <recipe>``: parse the shared flags, load the recipe's config, train (or submit to SLURM).

Design notes (``--resume`` of a finished run, ``--reevaluate``): ``docs/design/lm.md``.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

from ..engine.config import load_config, to_dict
from ..engine.run import FINISHED_MUTABLE, RESUME_WARN, RunDir, add_train_args, config_changes, resume_config
from ..engine.slurm import add_launcher_args, launcher_config, split_launcher_argv, submit_train
from ..engine.trackers import add_final_files
from ..outputs import read_json
from ..recipes import Recipe, get_recipe
from ..recipes.shipped import resolve_config


def _report_figures(run_dir: Path, out_dir: Path) -> list[tuple[Path, str]]:
    from ..report import run_figures  # lazy: matplotlib and the report only when a run has finished

    return run_figures(run_dir, out_dir)


def train(recipe_name: str, argv: Optional[Sequence[str]]) -> int:
    """``lapheads train RECIPE_NAME ARGV...``."""
    recipe = get_recipe(recipe_name)
    p = argparse.ArgumentParser(
        prog=f"lapheads train {recipe.name}",
        description=recipe.description,
        allow_abbrev=False,
        epilog=(
            "evaluation metrics (train.until_plateau.metric takes one): "
            + "; ".join(m.describe() for m in recipe.metrics)
            if recipe.metrics
            else None
        ),
    )
    add_train_args(p, None)  # no --config given: the recipe's default, or on --resume the run's saved config
    p.add_argument(
        "--reevaluate",
        action="store_true",
        help="with --resume of a finished run: evaluate its final model again and rewrite final/ "
        "(without it such a run is reported as finished and nothing is recomputed)",
    )
    add_launcher_args(p)
    args = p.parse_args(list(argv or []))
    slurm = launcher_config(args)  # --launcher slurm: its options (None: train here)
    args.config = args.config or resume_config(args.out, args.resume) or recipe.default_config
    config = resolve_config(recipe.name, args.config)
    if args.overwrite and not args.resume:  # before anything is loaded: --overwrite deletes a run, nothing else
        RunDir(args.out).check_overwrite(keep=[config] if config else [])
    cfg = load_config(recipe.config_type, config, args.overrides, recipe=recipe.name)
    if args.resume and not (args.overwrite or args.reevaluate) and _finished(recipe, cfg, Path(args.out)):
        return 0
    if slurm is not None:  # the config loaded above; the job runs this same command without the launcher flags
        submit_train(
            recipe.name,
            split_launcher_argv(list(argv or [])),
            args.out,
            slurm,
            args.slurm_folder,
            wait=not args.no_wait,
        )
        return 0
    add_final_files(_report_figures)  # the run's own report figures go to its trackers (the engine knows no report)
    result = recipe.train(cfg, args.out, resume=args.resume, overwrite=args.overwrite, reevaluate=args.reevaluate)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one report per job, not one per process
        for line in recipe.result_lines(result, args.out):
            print(line)
    return 0


def _finished(recipe: Recipe, cfg: Any, out: Path) -> bool:
    """Whether ``--resume`` of ``out`` has nothing to do (``final/`` written, the config the same up to keys
    that leave the trained model as it is); if so, says so with the run's final metrics."""
    run = RunDir(out)
    if not run.exists() or not recipe.finished(cfg, out):
        return False
    new = {"recipe": recipe.name, **to_dict(cfg)}
    allowed = FINISHED_MUTABLE | RESUME_WARN | (cfg.resume_mutable() if hasattr(cfg, "resume_mutable") else set())
    defaults = {"recipe": recipe.name, **to_dict(type(cfg)())}
    if config_changes(run.read_config(), new, allowed, defaults, same=recipe.same_setting):
        return False  # the trainer refuses the change, or continues a longer run
    final = read_json(run.final_dir / "model.json", "the final model of a run")
    print(
        f"--resume: {out} finished at step {final.get('step', '?')}; nothing to resume or recompute "
        f"(pass --reevaluate to evaluate its final model again)"
    )
    for line in recipe.result_lines(recipe.final_result(out), out):
        print(line)
    return True


# the functions lapheads.cli.COMMANDS names, one per recipe
classify = partial(train, "classify")
lm = partial(train, "lm")
sft = partial(train, "sft")
dino = partial(train, "dino")
retrofit = partial(train, "retrofit")
retrofit_vit = partial(train, "retrofit_vit")
