"""User-facing errors: every problem caused by what the user gave (a config value, a data file, a CLI
argument, a checkpoint) is a :class:`LapheadsError` (a ``ValueError``), whose message names the value
at fault and what was expected. The CLI prints it as one line and exits with status 2 (the traceback
only with ``--debug``).
"""

from __future__ import annotations


class LapheadsError(ValueError):
    """Base class of every error caused by user input."""


class ConfigError(LapheadsError):
    """A config file, a ``--set`` override or a keyword argument is invalid."""


class DataError(LapheadsError):
    """A data set, corpus, task file or tokenizer cannot be used."""


class CheckpointError(LapheadsError):
    """A checkpoint or run directory cannot be loaded or would be overwritten."""


class NonFiniteError(RuntimeError):
    """Training produced a NaN or Inf; raised by the engine's guard."""


class RunFailed(LapheadsError):
    """A run that a sweep trained in a subprocess ended with an error (its own error line is quoted)."""


# Rust libraries (safetensors) report a full disk (ENOSPC) or a used-up quota (EDQUOT) as text, "... (os error 28)".
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says that a write failed on a full disk or a used-up quota."""
    import errno

    if isinstance(exc, DiskFullError):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", 122)):
        return True
    return any(t in str(exc) for t in _DISK_FULL_TEXT) and not isinstance(exc, LapheadsError)


def human_bytes(n: "int | None") -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"an unknown amount"``."""
    if n is None:
        return "an unknown amount"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def free_bytes(path: "str | object") -> "int | None":
    """Free space (``shutil.disk_usage``) of the file system ``path`` (or its nearest existing parent) is on."""
    import shutil
    from pathlib import Path

    p = Path(str(path)).absolute()
    for cand in (p, *p.parents):
        try:
            return shutil.disk_usage(cand).free
        except OSError:
            continue
    return None


class DiskFullError(LapheadsError):
    """A write of a run failed, or would fail, because its disk is full or its quota is used up; the message
    names the directory, the need, the free space and (after :meth:`in_run`) the resume command.

    Attributes:
        directory: where the write went.
        needed: bytes the write needed (None when unknown).
        free: bytes free on that file system when the write failed (None when unknown).
        what: what was being written (``"checkpoint of step 20"``).
    """

    def __init__(
        self,
        directory: "str | object",
        needed: "int | None" = None,
        free: "int | None" = None,
        what: str = "a write",
        *,
        last_step: "int | None | str" = "unknown",
        run: "str | object | None" = None,
        resume: "str | None" = None,
    ):
        self.directory, self.needed, self.what = str(directory), needed, what
        self.free = free_bytes(directory) if free is None else free
        self.last_step, self.run, self.resume = last_step, run, resume
        need = f"needs {human_bytes(needed)}" if needed is not None else "could not finish"
        msg = f"no space left in {self.directory}: {what} {need}, {human_bytes(self.free)} free"
        if last_step != "unknown":
            msg += f"; last good checkpoint: {'none' if last_step is None else f'step {last_step}'}"
        where = str(run) if run is not None else "the run directory"
        msg += f"; free space or move {where} to a disk with room, then: {resume or 'rerun with --resume'}"
        super().__init__(msg)

    def in_run(self, run: "str | object", last_step: "int | None", resume: str) -> "DiskFullError":
        """The same error with the run, its last good checkpoint's step and the resume command."""
        return DiskFullError(
            self.directory, self.needed, self.free, self.what, last_step=last_step, run=run, resume=resume
        )
