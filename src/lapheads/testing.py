"""Fault injection for test suites, as engine callbacks (:mod:`lapheads.engine.callbacks`).

A process-local test registers :class:`NanLossAt` or :class:`CrashAfter`; other processes (torchrun
ranks, sweep workers, the CLI) get them through ``LAPHEADS_CALLBACKS=lapheads.testing:faults_from_env``,
which reads ``LAPHEADS_TEST_NAN_AT_STEP=N`` (the loss of optimizer step N becomes NaN) and
``LAPHEADS_TEST_CRASH_AFTER=N`` (a ``RuntimeError`` right after step N's update, before any
checkpoint) once, when a trainer is built. Nothing here is part of a config.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .engine.callbacks import Callback
from .errors import ConfigError

NAN_AT_STEP = "LAPHEADS_TEST_NAN_AT_STEP"
CRASH_AFTER = "LAPHEADS_TEST_CRASH_AFTER"

__all__ = ["NanLossAt", "CrashAfter", "faults_from_env", "NAN_AT_STEP", "CRASH_AFTER"]


class NanLossAt(Callback):
    """The loss of optimizer step ``step`` becomes NaN (every micro-batch of it)."""

    def __init__(self, step: int):
        self.step = step

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step == self.step else loss


class CrashAfter(Callback):
    """``RuntimeError`` right after optimizer step ``step``'s update, before any checkpoint of it."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"simulated crash after step {step} ({CRASH_AFTER})")


class _Both(Callback):
    def __init__(self, parts: list[Callback]):
        self.parts = parts

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for p in self.parts:
            loss = p.on_loss(step, loss)
        return loss

    def on_step_end(self, step: int) -> None:
        for p in self.parts:
            p.on_step_end(step)


def _step(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} must be an optimizer step (an int)") from None


def faults_from_env() -> Optional[Callback]:
    """The faults the environment asks for (see the module docstring), or None when it asks for none."""
    faults = ((NanLossAt, _step(NAN_AT_STEP)), (CrashAfter, _step(CRASH_AFTER)))
    parts: list[Callback] = [fault(step) for fault, step in faults if step is not None]
    return None if not parts else parts[0] if len(parts) == 1 else _Both(parts)
