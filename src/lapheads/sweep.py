"""``lapheads sweep``: one recipe over a grid of Laplacian-head settings and seeds, then a report.

::

    lapheads sweep --config recipes/classify/digits.yaml --laplacian-heads 0,2,all --seeds 0,1,2 \\
        --out runs/digits_sweep [--set data.epochs=5] [--analyze]

Every grid point is an ordinary run directory ``OUT/lap<k>_seed<s>`` made by the recipe's own
``lapheads train`` command (same flags, same layout). Design choices:

* Resumable: a finished run (``final/model.json`` exists) is skipped, an interrupted one
  continues with ``--resume`` from its newest checkpoint, a missing one starts (so does a
  directory left by a start killed before its ``config.yaml`` was complete).
* Never mixes settings: before anything runs, every existing run's ``config.yaml`` is compared
  with the config this sweep would write (engine.run.config_changes). Keys that never change
  the math (logging, evaluation and checkpoint cadence, progress bar, workers, device) may
  differ; ``train.max_steps`` may differ for an unfinished run (it resumes to the new length),
  not for a finished one. Any other difference stops the sweep with one line listing the runs
  and keys; ``--restart-changed`` trains those runs afresh instead and ``--overwrite`` (as for
  ``lapheads train``) restarts every run. Deletions happen before the first run trains, so an
  interrupted sweep resumes with the same command without those flags.
* One writer: the sweep holds the lock of ``OUT`` (engine.run.RunLock) for its whole duration,
  each run the lock of its own directory.
* Afterwards every run can be analysed (``--analyze``) and ``OUT/report/`` gets the comparison
  report (``lapheads report``).
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .engine.config import load_config, read_yaml, to_dict
from .engine.run import (FINISHED_MUTABLE, RESUME_MUTABLE, RunDir, clear_dir, config_changes,
                         describe_changes, lock_dir)
from .errors import ConfigError
from .heads import LaplacianHeads

SWEEP_HINT = ("pass --restart-changed to train them afresh, --overwrite to restart every run, "
              "or choose another --out")


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


def config_class(recipe_mod: Any) -> type:
    """The config dataclass of a recipe module (the annotation of ``build_task``'s ``cfg``)."""
    ann = inspect.signature(recipe_mod.build_task).parameters["cfg"].annotation
    return getattr(recipe_mod, ann) if isinstance(ann, str) else ann


@dataclass
class GridRun:
    """One grid point: its directory, its ``lapheads train`` flags, and how it stands."""

    path: Path
    sets: list[str]
    state: str  # run_state()
    resolved: dict = field(default_factory=dict)  # the config this sweep would write
    existing: dict = field(default_factory=dict)  # the config.yaml already there
    changes: list[str] = field(default_factory=list)  # keys that differ beyond what may differ

    def argv(self, config: Optional[str]) -> list[str]:
        out = (["--config", config] if config else []) + ["--out", str(self.path)]
        for s in self.sets:
            out += ["--set", s]
        return out + (["--resume"] if self.state == "partial" else [])


def plan_grid(recipe: str, config: Optional[str], heads: Sequence[str], seeds: Sequence[int], out: Path,
              overrides: Sequence[str] = ()) -> list[GridRun]:
    """Every grid point with its state and, for existing runs, the config keys that changed."""
    from .recipes import recipe_module
    cfg_cls = config_class(recipe_module(recipe))
    plan = []
    for k in heads:
        for seed in seeds:
            sets = [f"model.laplacian_heads={k}", f"train.seed={seed}", *overrides]
            run = GridRun(out / run_name(k, seed), sets, run_state(out / run_name(k, seed)))
            if run.state != "new":
                run.resolved = {"recipe": recipe, **to_dict(load_config(cfg_cls, config, sets, recipe=recipe))}
                run.existing = RunDir(run.path).read_config()
                allowed = FINISHED_MUTABLE if run.state == "done" else RESUME_MUTABLE
                run.changes = config_changes(run.existing, run.resolved, allowed)
            plan.append(run)
    return plan


def refuse_changed(plan: Sequence[GridRun], out: Path, hint: str = SWEEP_HINT) -> None:
    """One-line ConfigError listing the runs of ``plan`` made with other settings (if any)."""
    changed = [r for r in plan if r.changes]
    if not changed:
        return
    keys = sorted({k for r in changed for k in r.changes})
    first = changed[0]
    raise ConfigError(
        f"{len(changed)} existing run(s) in {out} ({', '.join(r.path.name for r in changed)}) were made "
        f"with other settings than this command's: {', '.join(keys)} (e.g. {first.path.name}: "
        f"{describe_changes(first.existing, first.resolved, first.changes, limit=3)}); {hint}")


def _restart(run: GridRun) -> None:
    """Delete a grid run (under its lock, so never under a live writer)."""
    with lock_dir(run.path):
        clear_dir(run.path)
    try:
        run.path.rmdir()
    except OSError:
        pass
    run.state = "new"


def run_grid(recipe: str, config: Optional[str], heads: Sequence[str], seeds: Sequence[int], out: Path,
             overrides: Sequence[str] = (), quiet: bool = False, *, overwrite: bool = False,
             restart_changed: bool = False, hint: str = SWEEP_HINT) -> list[Path]:
    """Train every (k, seed) point that is not finished yet; returns the run directories.

    Raises ConfigError (before anything runs) when existing runs were made with other settings,
    unless ``restart_changed`` (those runs start afresh) or ``overwrite`` (every run does);
    ``hint`` is the advice appended to that error.
    """
    from .recipes import recipe_module
    mod = recipe_module(recipe)
    with lock_dir(out):
        plan = plan_grid(recipe, config, heads, seeds, out, overrides)
        if not (overwrite or restart_changed):
            refuse_changed(plan, out, hint)
        for r in plan:
            if r.state != "new" and (overwrite or r.changes):
                if not quiet:
                    why = f"settings changed: {', '.join(r.changes)}" if r.changes else "--overwrite"
                    print(f"[sweep] {r.path.name}: deleted to start afresh ({why})")
                _restart(r)
        for r in plan:
            if r.state == "done":
                if not quiet:
                    print(f"[sweep] {r.path.name}: finished, skipped")
                continue
            if not quiet:
                print(f"[sweep] {r.path.name}: {'resuming' if r.state == 'partial' else 'training'}")
            mod.train_main(r.argv(config))
    return [r.path for r in plan]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads sweep", allow_abbrev=False,
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
    p.add_argument("--overwrite", action="store_true",
                   help="delete every existing run of the grid first and train them all afresh")
    p.add_argument("--restart-changed", action="store_true",
                   help="train afresh the existing runs whose config differs from this command's "
                        "(default: stop and list them)")
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
    with lock_dir(out):
        dirs = run_grid(recipe, args.config, heads, seeds, out, args.overrides, overwrite=args.overwrite,
                        restart_changed=args.restart_changed)
        if args.analyze:
            from .geometry.runs import analyze_run
            for d in dirs:
                with lock_dir(d):
                    analyze_run(d)
        if not args.no_report:
            from .report import build_report
            paths = build_report(dirs, out / "report", title=f"Sweep: {Path(args.config).name}")
            print(f"report: {paths['html']}")
    return 0
