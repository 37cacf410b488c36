"""Run untrusted (model-written) Python code under bubblewrap, away from the host.

``run_code(code, timeout=5)`` runs one program in a fresh interpreter inside new user, PID, IPC,
network, UTS and mount namespaces, on a read-only view of the interpreter and its standard library,
with a private tmpfs, a seccomp filter and resource limits set by the trusted parent; it returns an
:class:`ExecResult` (``passed``, ``status``, output, the isolation used) and never raises for what
the program does.

Nothing in it knows about language models: any caller that must execute code it did not write can
use it. When bubblewrap cannot run here, nothing is run unless the caller opts in
(``allow_unsafe=True``); :func:`require_sandbox` raises :class:`SandboxUnavailableError` otherwise,
and :func:`sandbox_status` says why. Threat model and design: ``docs/sandbox.md``.
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
