"""``lapheads train <recipe>``: parse the shared flags, build the task, run the engine.

Order matters for "nothing is lost, nothing half-written": the run directory is checked first
(no overwrite without --resume/--overwrite), then the recipe builds its task, which validates
every data file and config value, then the trainer is built (it checks the run length and, on
--resume, loads the newest checkpoint), and only then is the first file written.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

from . import dist as D
from .config import load_config
from .run import RunDir, add_train_args
from .trainer import Task, Trainer, seed_everything


def launch(recipe: str, cfg: Any, build_task: Callable[[Any, D.DistInfo], Task], out: str, *,
           resume: bool = False, overwrite: bool = False) -> dict:
    """Train ``recipe`` with config ``cfg`` (which has a ``train`` section) into run dir ``out``."""
    info = D.init_distributed(cfg.train.device)
    try:
        run = RunDir(out)
        run.prepare(cfg, recipe, resume=resume, overwrite=overwrite, is_main=info.is_main, write=False)
        D.barrier()  # every rank has checked before rank 0 writes anything
        seed_everything(cfg.train.seed)  # model initialisation is identical on every rank
        task = build_task(cfg, info)
        # Built before the first write: it checks the run length, and on --resume loads the
        # checkpoint, so a bad value or a bad checkpoint leaves no (changed) run directory behind.
        trainer = Trainer(task, cfg.train, run, info)
        if resume:
            trainer.restore()
        if info.is_main:
            run.prepare(cfg, recipe, resume=resume, overwrite=overwrite, is_main=True)
        D.barrier()
        return trainer.fit(resume=resume)
    finally:
        D.cleanup()


def train_cli(recipe: str, cfg_cls: type, build_task: Callable[[Any, D.DistInfo], Task],
              argv: Optional[Sequence[str]], *, default_config: Optional[str] = None,
              description: str = "") -> int:
    p = argparse.ArgumentParser(prog=f"lapheads train {recipe}", description=description)
    add_train_args(p, default_config)
    args = p.parse_args(list(argv or []))
    cfg = load_config(cfg_cls, args.config, args.overrides, recipe=recipe)
    res = launch(recipe, cfg, build_task, args.out, resume=args.resume, overwrite=args.overwrite)
    if res:
        print("final:", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in res.items()))
    print(f"run directory: {args.out}")
    return 0
