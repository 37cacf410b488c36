"""Output paths every command checks before it works and cleans up after it fails; atomic writes.
Design notes: docs/design/engine.md (Outputs)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import CheckpointError, ConfigError, DiskFullError, is_disk_full

_RAISE: Any = object()  # read_json: a missing file is an error


def _nearest_existing(p: Path) -> Path:
    for a in (p, *p.parents):
        if a.exists() or a.is_symlink():
            return a
    return Path(os.getcwd())  # only reached for a relative path in a vanished working directory


def _check_can_create_in(parent: Path, target: Path, flag: str) -> None:
    """``target`` (missing) can be created under the existing ``parent``, or raise ConfigError."""
    if not parent.is_dir():
        kind = "a file" if parent.is_file() else "not a directory"
        raise ConfigError(f"{flag} {target} cannot be created: {parent} is {kind}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lapheads-write-test-", dir=parent))
    except OSError as e:
        raise ConfigError(f"{flag} {target} cannot be created: {parent} is not writable ({e.strerror or e})") from None


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check that ``path`` (``flag`` for messages) is or can become a writable directory; nothing is created.

    Raises:
        ConfigError: it is an existing file, a parent is a file, or it cannot be written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is an existing file; give a directory (it holds several files)")
    _check_can_create_in(_nearest_existing(p), p, flag)
    return p


def check_out_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check that ``path`` is a file that can be written (created or replaced); nothing is created.

    Raises:
        ConfigError: it is a directory, a parent is a file, or its directory cannot be written.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {p} is a directory; give the name of the file to write")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag} {p} exists and is not a regular file")
    _check_can_create_in(_nearest_existing(p.parent), p, flag)
    return p


def _entries(root: Path) -> set[Path]:
    return {Path(d) / n for d, dirs, files in os.walk(root) for n in (*dirs, *files)}


@contextlib.contextmanager
def removed_on_failure(path: str | os.PathLike, *, remove_new_entries: bool = True) -> Iterator[Path]:
    """Remove what the ``with`` block wrote under ``path`` if it raises an ``Exception``.

    A directory the block created is removed entirely; in an existing one, the entries the block added
    (unless ``remove_new_entries=False``). ``KeyboardInterrupt`` / ``SystemExit`` keep everything."""
    p = Path(path)
    missing = list(itertools.takewhile(lambda a: not a.exists(), (p, *p.parents)))
    created = missing[-1] if missing else None  # the topmost directory the block may create
    before = _entries(p) if created is None and remove_new_entries and p.is_dir() else None
    try:
        yield p
    except Exception:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif before is not None:
            for e in sorted(_entries(p) - before, key=lambda e: len(e.parts)):
                if e.is_dir() and not e.is_symlink():
                    shutil.rmtree(e, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        e.unlink()
        raise


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` durable (a rename in it survives a crash); a file
    system that cannot fsync a directory is left as it is."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` so that readers see the old or the new content,
    never a mix, also after a crash (temporary file, fsync, rename, directory fsync).

    Raises:
        DiskFullError: the disk is full or the quota used up (the temporary file is removed).
    """
    p = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:  # a signal too: no temporary file is left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_disk_full(e) and not isinstance(e, DiskFullError):
            raise DiskFullError(p.parent, len(raw), what=f"writing {p.name}") from None
        raise
    fsync_dir(p.parent)


def write_json(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON in ``path``, written with :func:`atomic_write`."""
    atomic_write(path, json.dumps(data, indent=1) + "\n")


def read_json(path: str | os.PathLike, what: str = "", *, missing: Any = _RAISE) -> Any:
    """``json.loads`` of a file, with a one-line :class:`CheckpointError` naming it (and ``what`` it should
    be) on failure; ``missing`` is returned when the file does not exist (default: an error too)."""
    p = Path(path)
    hint = f" ({what})" if what else ""
    if missing is not _RAISE and not p.exists() and not p.is_symlink():
        return missing
    if not p.is_file():
        raise CheckpointError(f"{p} does not exist{hint}" if not p.exists() else f"{p} is not a file{hint}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{p} is not JSON text{hint}: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{p} is not valid JSON{hint}: {e.msg} at line {e.lineno}, column {e.colno}; "
            "the file is corrupt or was edited by hand"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{p} cannot be read{hint}: {e.strerror or e}") from None
