"""HumanEval-style programs (prompt + completion + tests) run in the sandbox.

A problem passes when its program reaches its end in :func:`lapheads.sandbox.run_code` (docs/sandbox.md).
"""

from __future__ import annotations

from typing import Any

from .core import ExecResult, run_code

__all__ = ["build_humaneval_program", "check_program"]


def build_humaneval_program(problem_prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program HumanEval runs: prompt + completion + test + ``check(entry_point)``.

    Args:
        problem_prompt: the problem's prompt (imports, signature and docstring).
        completion: the function body continuing the prompt.
        test: the problem's test code defining ``check(candidate)``.
        entry_point: the name of the function under test.
    """
    return f"{problem_prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"


def check_program(
    problem_prompt: str, completion: str, test: str, entry_point: str, timeout: float = 5.0, **kwargs: Any
) -> ExecResult:
    """Run :func:`build_humaneval_program`'s program for one completion with :func:`run_code`
    (``timeout`` in wall-clock seconds, ``**kwargs`` its other limits)."""
    return run_code(build_humaneval_program(problem_prompt, completion, test, entry_point), timeout=timeout, **kwargs)
