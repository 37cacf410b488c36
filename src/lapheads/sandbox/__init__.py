"""Run untrusted (model-written) Python code under bubblewrap, away from the host.

``run_code(code, timeout=5)`` runs one program and returns an :class:`ExecResult`; it never raises for
what the program does. Where bubblewrap cannot run, nothing runs unless the caller opts in
(``allow_unsafe=True``); :func:`sandbox_status` says why. Threat model and design: ``docs/sandbox.md``.
"""

from __future__ import annotations

from .core import (
    UID_RANGE,
    ExecResult,
    SandboxStatus,
    SandboxUnavailableError,
    require_sandbox,
    run_code,
    run_many,
    sandbox_status,
)
from .humaneval import build_humaneval_program, check_program

__all__ = [
    "ExecResult",
    "SandboxStatus",
    "SandboxUnavailableError",
    "run_code",
    "run_many",
    "check_program",
    "build_humaneval_program",
    "sandbox_status",
    "require_sandbox",
    "UID_RANGE",
]
