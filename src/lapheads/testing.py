"""Fault injection for the test suite: the one testing hook in the product, off unless asked for.

The engine asks this module, once per optimizer step, whether to break the step. Nothing here is
part of any config (a config describes a model and its training, not a test), so runs, their
``config.yaml`` and ``--resume`` never see it. A test sets an environment variable (inherited by
the subprocesses and torchrun ranks it starts) and clears it to resume:

=================================  ===================================================================
``LAPHEADS_TEST_NAN_AT_STEP=N``    the loss of optimizer step N becomes NaN (the non-finite guard)
``LAPHEADS_TEST_CRASH_AFTER=N``    ``RuntimeError("simulated crash ...")`` right after step N's update
                                   (and the task's ``after_optimizer_step``), before any checkpoint
=================================  ===================================================================
"""

from __future__ import annotations

import os
from typing import Optional

from .errors import ConfigError

NAN_AT_STEP = "LAPHEADS_TEST_NAN_AT_STEP"
CRASH_AFTER = "LAPHEADS_TEST_CRASH_AFTER"


def _step(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} must be an optimizer step (an int)") from None


class Faults:
    """The faults asked for when a run starts (read once: a step loop never re-reads the environment)."""

    def __init__(self) -> None:
        self.nan_at, self.crash_after = _step(NAN_AT_STEP), _step(CRASH_AFTER)

    def nan_loss(self, step: int) -> bool:
        return step == self.nan_at

    def after_update(self, step: int) -> None:
        if step == self.crash_after:
            raise RuntimeError(f"simulated crash after step {step} ({CRASH_AFTER})")
