"""Launch a training run on the engine (``lapheads train <recipe>``), and describe an interrupted one.
Design notes: docs/design/engine.md (Launching a run)."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import DiskFullError, is_disk_full
from . import dist as D
from .checkpoint import last_good_step, latest_checkpoint
from .run import RunDir, SameValue
from .signals import RunInterrupted
from .threads import configure_threads
from .train_state import seed_everything
from .train_task import TrainTask
from .trainer import Trainer


def launch(
    recipe: str,
    cfg: Any,
    build_task: Callable[[Any, D.DistInfo], TrainTask],
    out: str,
    *,
    resume: bool = False,
    overwrite: bool = False,
    same: Optional[SameValue] = None,
    reevaluate: bool = False,
) -> dict:
    """Train ``recipe`` with config ``cfg`` (which has a ``train`` section) into run dir ``out``.

    ``same`` is the recipe's rule for equal config values on ``--resume``; ``reevaluate``: a resumed
    run that had finished evaluates its final model again."""
    info = D.init_distributed(cfg.train.device)
    threads, why = configure_threads(cfg.train.threads)  # before any tensor work (engine/threads.py)
    if info.is_main and cfg.train.progress:
        print(f"CPU threads: {threads} ({why})", flush=True)
    run = RunDir(out)
    started = False
    trainer: Optional[Trainer] = None
    try:
        outcome: Any = None
        if info.is_main:
            try:
                run.lock()
                outcome = run.check(cfg, recipe, resume=resume, overwrite=overwrite, same=same)
            except Exception as e:  # handed to the other ranks, which raise it too
                outcome = e
        resume = D.agree(info, outcome)
        seed_everything(cfg.train.seed)  # model initialisation is identical on every rank
        task = build_task(cfg, info)
        # Built before the first write: it checks the run length, and on --resume loads the
        # checkpoint, so a bad value or a bad checkpoint leaves no (changed) run directory behind.
        trainer = Trainer(task, cfg.train, run, info)
        if resume:
            trainer.restore()
        started = True
        if info.is_main:
            run.prepare(cfg, recipe, resume=resume, overwrite=overwrite, same=same)
        D.barrier()
        return trainer.fit(resume=resume, reevaluate=reevaluate)
    except RunInterrupted:
        raise
    except (DiskFullError, OSError) as e:
        if not is_disk_full(e):
            raise
        # the trainer knows the checkpoint it wrote or resumed from (latest may name a damaged one it skipped)
        last: Any = "pointer" if trainer is None else trainer.checkpoints.last_step
        raise disk_full_in_run(e, recipe, run.path, last) from None
    except KeyboardInterrupt as e:  # outside the loop: Ctrl-C, or SIGTERM via the CLI's handler
        signum = getattr(e, "signum", signal.SIGINT)
        ck = latest_checkpoint(run.ckpt_dir) if (started and info.is_main and run.ckpt_dir.is_dir()) else None
        raise RunInterrupted(signum, run.path, None, ck, started=started) from None
    finally:
        run.unlock()
        D.cleanup()


def disk_full_in_run(exc: BaseException, recipe: str, run_dir: Path, last_step: Any = "pointer") -> DiskFullError:
    """The one-line :class:`DiskFullError` of a run whose write ``exc`` met a full disk, with the last
    good checkpoint (``last_step``; by default the step ``latest`` names) and the command that continues it."""
    if not isinstance(exc, DiskFullError):
        name = getattr(exc, "filename", None)
        where = Path(name).parent if name else run_dir
        exc = DiskFullError(where, None, what=f"writing {Path(name).name}" if name else "a write")
    resume = resume_command(["train", recipe], ["--out", str(run_dir)])
    if last_step == "pointer":
        last_step = last_good_step(Path(run_dir) / "checkpoints")
    return exc.in_run(run_dir, last_step, resume)


def resume_command(words: Sequence[str], args: Sequence[str], started: bool = True) -> str:
    """The command line that continues an interrupted ``lapheads WORDS ARGS``: without ``--overwrite`` /
    ``--restart-changed``, with ``--resume`` for a started train command, under torchrun when it ran there."""
    if not started:
        rest = list(args)
    else:
        rest = [a for a in args if a not in ("--overwrite", "--restart-changed")]
        if words and words[0] == "train" and "--resume" not in rest:
            rest.append("--resume")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = ["lapheads"] if world <= 1 else ["torchrun", f"--nproc_per_node={world}", "-m", "lapheads.cli"]
    return shlex.join([*prefix, *words, *rest])


def describe_interrupt(words: Sequence[str], args: Sequence[str], exc: BaseException) -> tuple[Optional[str], int]:
    """The one stderr line (None on ranks other than 0) and the exit status of a command ended by a signal."""
    signum = int(getattr(exc, "signum", signal.SIGINT))
    rc = 128 + signum
    if int(os.environ.get("RANK", "0")) != 0:
        return None, rc
    name = signal.Signals(signum).name
    head = f"lapheads {' '.join(words)}: interrupted by {name}"
    if isinstance(exc, RunInterrupted):
        # a sweep's or quickstart's own flags took effect before its first run started
        started = exc.started or words[0] != "train"
        how = "resume with" if started else "rerun with"
        return f"{head} {exc.describe()}; {how}: {resume_command(words, args, started)}", rc
    if words and words[0] in ("sweep", "quickstart"):
        return f"{head}; resume with: {resume_command(words, args)}", rc
    if words and words[0] == "train":  # stopped before launch() (e.g. while reading the config)
        return f"{head}; rerun with: {resume_command(words, args, started=False)}", rc
    return head, rc
