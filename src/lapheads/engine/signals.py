"""Stopping a run cleanly at a step boundary on SIGINT, SIGTERM and SLURM's SIGUSR1.
Design notes: docs/design/engine.md (Signals)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from .dist import all_max


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal at a step boundary (or before / after training).

    ``step`` is None when it stopped outside the loop, ``checkpoint`` the newest complete one (or
    None), ``started`` whether this attempt wrote ``config.yaml``, ``finished`` whether ``final/`` was."""

    def __init__(
        self,
        signum: int,
        run_dir: Path,
        step: Optional[int],
        checkpoint: Optional[Path],
        started: bool = True,
        finished: bool = False,
    ):
        self.signum, self.run_dir, self.step = int(signum), Path(run_dir), step
        self.checkpoint, self.started, self.finished = checkpoint, started, finished
        super().__init__(self.describe())

    def describe(self) -> str:
        if not self.started:
            return f"before training started, nothing was written to {self.run_dir}"
        where = f"after step {self.step} of {self.run_dir}" if self.step is not None else f"in {self.run_dir}"
        if self.finished:
            where += " (the run had finished)"
        if self.checkpoint is None:
            return f"{where}; no checkpoint yet, it restarts at step 0"
        return f"{where}; checkpoint {self.checkpoint} is complete"


class StopSignals:
    """While entered, SIGINT / SIGTERM / SIGUSR1 only record themselves in :attr:`signum`."""

    def __init__(self) -> None:
        self.signum = 0  # the first signal received (0: none)
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        if signum != signal.SIGUSR1:  # SIGUSR1 may come twice; a second SIGINT / SIGTERM acts at once
            signal.signal(signum, self._previous[signum])

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
            self._previous = {s: signal.getsignal(s) for s in sigs if signal.getsignal(s) not in (signal.SIG_IGN, None)}
            for s in self._previous:
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def requested(self, device: torch.device) -> int:
        """The signal every rank agrees to stop on (0: none); one small all-reduce under torchrun."""
        return all_max(self.signum, device)
