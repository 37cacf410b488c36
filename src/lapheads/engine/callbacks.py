"""Callbacks: code outside the engine that watches or alters a training step.
Design notes: docs/design/engine.md (Callbacks)."""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Iterator

import torch

from ..errors import ConfigError

__all__ = ["Callback", "register", "unregister", "registered", "active_callbacks", "ENV"]

ENV = "LAPHEADS_CALLBACKS"

_REGISTERED: list["Callback"] = []


class Callback:
    """Hooks of the step loop; override what applies (the defaults do nothing)."""

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss before the non-finite check and backward; returns the loss to use."""
        return loss

    def on_step_end(self, step: int) -> None:
        """After step ``step``'s optimizer update (and the task's ``after_optimizer_step``), before
        any checkpoint of it."""


def register(callback: Callback) -> Callback:
    """Make ``callback`` active for trainers built from now on in this process; returns it."""
    if not isinstance(callback, Callback):
        raise TypeError(f"expected a lapheads.engine.callbacks.Callback, got {type(callback).__name__}")
    _REGISTERED.append(callback)
    return callback


def unregister(callback: Callback) -> None:
    """Undo :func:`register` (a callback that is not registered is ignored)."""
    if callback in _REGISTERED:
        _REGISTERED.remove(callback)


@contextlib.contextmanager
def registered(*callbacks: Callback) -> Iterator[None]:
    """Register ``callbacks`` for the duration of a ``with`` block."""
    for cb in callbacks:
        register(cb)
    try:
        yield
    finally:
        for cb in callbacks:
            unregister(cb)


def _from_spec(spec: str) -> Callback | None:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{ENV}: {spec!r} must look like module:name (e.g. lapheads.testing:faults_from_env)")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{ENV}: cannot import {spec!r} ({e}); fix or unset {ENV}") from None
    if not callable(factory):
        raise ConfigError(f"{ENV}: {spec!r} is a {type(factory).__name__}, not a Callback class or factory")
    made = factory()
    if made is not None and not isinstance(made, Callback):
        raise ConfigError(f"{ENV}: {spec!r} gave a {type(made).__name__}, not a lapheads Callback")
    return made


def active_callbacks() -> list[Callback]:
    """The callbacks a trainer built now runs: the registered ones, then those named in ``LAPHEADS_CALLBACKS``."""
    specs = [s.strip() for s in os.environ.get(ENV, "").split(",") if s.strip()]
    from_env = [cb for cb in (_from_spec(s) for s in specs) if cb is not None]
    return [*_REGISTERED, *from_env]
