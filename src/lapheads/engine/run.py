"""Run directories: one layout (docs/runs.md) for every ``lapheads train ...`` command.
Design notes: docs/design/engine.md (Run directories)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import yaml

from ..errors import CheckpointError, ConfigError, DiskFullError, LapheadsError, is_disk_full
from ..outputs import atomic_write, check_out_dir, read_json, write_json
from .config import flatten_config, load_yaml, to_dict
from .trackers import STATE_FILE as TRACKERS_FILE

LOCK_NAME = ".lock"
SWEEP_RECORD = "sweep_command.json"  # what makes a directory a sweep (lapheads sweep writes it)
# The top-level entries lapheads writes into a run directory: the training files (docs/design/engine.md),
# engine.slurm's record of the SLURM attempts, engine.trackers' ids and W&B's offline folder, the
# analysis of ``lapheads.runs.analyze_run`` and a retrofit's comparison. --overwrite deletes these and
# refuses anything else.
RUN_ENTRIES = frozenset(
    [LOCK_NAME, TRACKERS_FILE, *"config.yaml meta.json metrics.jsonl samples.jsonl tb checkpoints final".split()]
    + "slurm.json wandb geometry retrofit.json".split()
)
NESTED_RUNS = frozenset({"baseline"})  # runs inside a run: a retrofit's baseline (its own entries checked too)
_TMP = re.compile(r"\.(?P<name>.+)\.tmp-\d+")  # outputs.atomic_write's temporary file of NAME


def git_revision() -> Optional[str]:
    """The git commit of the lapheads source tree (with ``-dirty``), or None outside git."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5)

    try:
        rev = git("rev-parse", "HEAD")
        if rev.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def add_train_args(p: argparse.ArgumentParser, default_config: Optional[str] = None) -> None:
    """The flags every ``lapheads train ...`` command shares."""
    p.add_argument(
        "--config",
        default=default_config,
        help="a YAML recipe file or a shipped config name (`lapheads recipes`); values can be overridden with --set; with --resume and "
        "no --config the run directory's config.yaml",
    )
    p.add_argument("--out", required=True, help="run directory to create (or continue with --resume)")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its newest complete checkpoint"
    )
    p.add_argument("--overwrite", action="store_true", help="delete an existing --out first")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.max_steps=100 --set optim.lr=0.01 (repeatable)",
    )


def resume_config(out: str | Path, resume: bool) -> Optional[str]:
    """The config a ``--resume`` without ``--config`` continues with: ``OUT/config.yaml`` (None when
    not resuming); a :class:`CheckpointError` when ``OUT`` holds no run."""
    if not resume:
        return None
    saved = Path(out) / "config.yaml"
    if not saved.is_file():
        raise CheckpointError(
            f"--resume: {out} is not a run directory (no config.yaml), so there is no config to continue "
            f"with; start a run there with --config and without --resume"
        )
    return str(saved)


# Keys that may differ between the original run and a --resume (they do not change the math).
RESUME_MUTABLE = {
    f"train.{key}"
    for key in "max_steps log_every eval_every ckpt_every keep_checkpoints progress num_workers device".split()
    # where metrics are mirrored (engine.trackers), never what is trained
    + "trackers tracker_project tracker_run_name tracker_dir mlflow_tracking_uri".split()
}
# Keys that may differ on --resume with one warning line: CPU threads can change the last bits of sums.
RESUME_WARN = {"train.threads"}
# Keys that may differ for a FINISHED run that is reused as is (e.g. by a sweep): the run length
# decides the final model, so it is not among them.
FINISHED_MUTABLE = RESUME_MUTABLE - {"train.max_steps"}


SameValue = Callable[[str, Any, Any], bool]
"""``same(key, old, new)``: whether two values of a dotted config key are the same setting."""


def _equal(key: str, old: Any, new: Any) -> bool:
    return old == new


def config_changes(
    old: dict, new: dict, allowed: set[str] = RESUME_MUTABLE, defaults: Optional[dict] = None, same: SameValue = _equal
) -> list[str]:
    """Dotted keys whose values differ between two resolved configs, ``allowed`` keys left out.

    With ``defaults`` (the recipe's defaults), a key the old config lacks is no change while the new
    one leaves it at its default. ``same`` is the recipe's equality rule (plain ``==`` by default)."""
    a, b = flatten_config(old), flatten_config(new)
    d = flatten_config(defaults) if defaults is not None else {}
    return sorted(
        k
        for k in set(a) | set(b)
        if not same(k, a.get(k), b.get(k)) and k not in allowed and not (k not in a and k in d and b.get(k) == d[k])
    )


def describe_changes(old: dict, new: dict, keys: list[str], limit: int = 6) -> str:
    """``"model.depth (2 -> 3), optim.lr (0.1 -> 0.5)"`` for the first ``limit`` keys."""
    a, b = flatten_config(old), flatten_config(new)
    parts = [f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in keys[:limit]]
    return ", ".join(parts) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


class RunDirBusy(CheckpointError):
    """Another live process holds the directory's lock."""


class RunLock:
    """Exclusive, process-lifetime, re-entrant ``fcntl`` lock of a directory (``DIR/.lock`` names the holder).

    Directories created to hold the lock file are removed on release when they are still empty."""

    _held: dict[Path, "RunLock"] = {}

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self.created = path, fd, created  # created: the directories made for the lock
        self._count, self._pid = 1, os.getpid()

    @classmethod
    def acquire(cls, path: str | Path) -> "RunLock":
        path = Path(path)
        key = path.resolve()
        held = cls._held.get(key)
        if held is not None and held._pid == os.getpid():
            held._count += 1
            return held
        check_out_dir(path)  # a file, a parent that is a file, an unwritable place: one line, no traceback
        created = []
        for parent in reversed([path, *path.parents]):
            if not parent.exists():
                with contextlib.suppress(FileExistsError):
                    parent.mkdir()
                    created.append(parent)
        if not path.is_dir():
            raise CheckpointError(f"{path} is not a directory")
        lock_file = path / LOCK_NAME
        while True:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = _describe_holder(os.pread(fd, 4096, 0))
                os.close(fd)
                raise RunDirBusy(
                    f"{path} is being written by another process ({holder}); two writers would "
                    f"corrupt it: wait for that process to end or stop it first"
                ) from None
            with contextlib.suppress(FileNotFoundError):  # the previous holder may have unlinked it meanwhile
                if os.path.samestat(os.stat(lock_file), os.fstat(fd)):
                    break
            os.close(fd)
        info = {
            "pid": os.getpid(),
            "host": platform.node(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": shlex.join(sys.argv),
        }
        record = (json.dumps(info) + "\n").encode()
        lock = cls(path, fd, created)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except OSError as e:  # a full disk: give the lock back, leave nothing behind, say so in one line
            lock.release()
            if is_disk_full(e):
                raise DiskFullError(path, len(record), what=f"the writer lock {lock_file}") from None
            raise
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        self._count -= 1
        if self._count > 0 or self._fd < 0:
            return
        RunLock._held.pop(self.path.resolve(), None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path / LOCK_NAME)  # still locked: a waiting opener sees the inode change
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1
        for d in reversed(self.created):  # deepest first; only those still empty
            with contextlib.suppress(OSError):
                d.rmdir()


def _describe_holder(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode())
        return f"PID {info['pid']} on host {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "a process that has not written its PID yet"


@contextlib.contextmanager
def lock_dir(path: str | Path) -> Iterator[RunLock]:
    """Hold :class:`RunLock` on ``path`` for the ``with`` block."""
    lock = RunLock.acquire(path)
    try:
        yield lock
    finally:
        lock.release()


def lock_enclosing_run(path: str | Path) -> contextlib.AbstractContextManager:
    """Hold the lock of the run directory ``path`` is in (``path`` or its nearest parent whose
    ``config.yaml`` names a recipe), if any (no-op outside run directories)."""
    p = Path(path).absolute()
    for cand in (p, *p.parents):
        try:
            RunDir(cand).read_config()
        except (OSError, UnicodeDecodeError, LapheadsError):  # no config.yaml, invalid YAML, no recipe
            continue
        return lock_dir(cand)
    return contextlib.nullcontext()


def _written_by_lapheads(name: str) -> bool:
    """Whether a top-level entry of a run directory is one of :data:`RUN_ENTRIES` (or its temporary file)."""
    tmp = _TMP.fullmatch(name)
    return (tmp.group("name") if tmp else name) in RUN_ENTRIES


def _foreign_entries(run: Path) -> list[str]:
    """The entries of run directory ``run`` that are not its own (nested runs' as ``baseline/x``)."""
    out = []
    for c in sorted(run.iterdir(), key=lambda c: c.name):
        if c.name in NESTED_RUNS and c.is_dir() and not c.is_symlink() and (c / "config.yaml").is_file():
            out += [f"{c.name}/{n}" for n in _foreign_entries(c)]
        elif not _written_by_lapheads(c.name):
            out.append(c.name)
    return out


class RunDir:
    """A run directory (docs/runs.md)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock: Optional[RunLock] = None
        self._warned = False  # the RESUME_WARN line is printed once (check() runs twice per start)

    config_path = property(lambda self: self.path / "config.yaml")
    metrics_path = property(lambda self: self.path / "metrics.jsonl")
    ckpt_dir = property(lambda self: self.path / "checkpoints")
    final_dir = property(lambda self: self.path / "final")
    tb_dir = property(lambda self: self.path / "tb")

    def exists(self) -> bool:
        return self.config_path.is_file()

    def state(self) -> str:
        """``done`` (the final model is written), ``partial`` (started: resumable) or ``new``."""
        if (self.final_dir / "model.json").is_file():
            return "done"
        return "partial" if self.exists() else "new"

    def read_json(self, name: str, what: str = "", *, missing: Any = None) -> Any:
        """The JSON file ``name`` of the run (:func:`lapheads.outputs.read_json`)."""
        return read_json(self.path / name, what or f"a file of the run {self.path}", missing=missing)

    def write_json(self, name: str, data: Any) -> None:
        """Write the JSON file ``name`` of the run atomically."""
        write_json(self.path / name, data)

    def lock(self) -> RunLock:
        """Take the writer lock (before anything is checked, written or cleaned up)."""
        if self._lock is None:
            self._lock = RunLock.acquire(self.path)
        return self._lock

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _only_leftovers(self) -> bool:
        """Whether the directory holds only what a start killed before ``config.yaml`` was complete left."""
        leftovers = (".config.yaml.tmp-", ".meta.json.tmp-")
        return self.path.is_dir() and all(
            c.name == LOCK_NAME or c.name.startswith(leftovers) for c in self.path.iterdir()
        )

    def check_overwrite(self, keep: Sequence[str | Path] = (), flag: str = "--overwrite") -> None:
        """Refuse (one :class:`CheckpointError` line), before anything is deleted, an ``--overwrite``
        (``flag``) that would delete more than a run, or one of the ``keep`` paths (docs/design/engine.md)."""
        if not self.path.is_dir() or self._only_leftovers():
            return
        where = self.path.resolve()
        cwd = Path.cwd().resolve()
        if cwd.is_relative_to(where):
            what = "the current directory" if where == cwd else f"an ancestor of the current directory {cwd}"
            raise CheckpointError(
                f"{flag} would delete {self.path}, {what}; {flag} only replaces a run directory "
                f"below the one you are in: choose another --out"
            )
        for k in keep:
            if Path(k).resolve().is_relative_to(where):
                raise CheckpointError(
                    f"{flag} would delete {k}, which this command reads, with {self.path}: move it out of "
                    f"{self.path} first or choose another --out"
                )
        if not self.exists():
            kind = "a sweep directory" if (self.path / SWEEP_RECORD).is_file() else "not a run directory"
            raise CheckpointError(
                f"{flag} refuses {self.path}: it is {kind} (no config.yaml), and {flag} deletes "
                f"only a run; choose another --out, or delete its files yourself"
            )
        foreign = _foreign_entries(self.path)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise CheckpointError(
                f"{flag} refuses {self.path}: it holds {foreign[0]}{more}, which is not one of the run's own "
                f"files ({flag} deletes only those); move it elsewhere or choose another --out"
            )

    def clear(self) -> None:
        """Delete the run's own files (not the lock file), after :meth:`check_overwrite`."""
        self.check_overwrite()
        for child in self.path.iterdir():
            if child.name == LOCK_NAME or not (_written_by_lapheads(child.name) or child.name in NESTED_RUNS):
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def check(self, cfg: Any, recipe: str, *, resume: bool, overwrite: bool, same: Optional[SameValue] = None) -> bool:
        """Check, touching nothing, that the run can start here; returns whether it resumes a run.

        ``same`` is the recipe's rule for equal values (:func:`config_changes`)."""
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")
        if overwrite:
            self.check_overwrite()
        if resume:
            missing = not self.path.is_dir() or (self._lock is not None and self.path in self._lock.created)
            if not self.exists():
                if missing or not self._only_leftovers():
                    raise CheckpointError(f"--resume: {self.path} is not a run directory (no config.yaml)")
                return False
            old = load_yaml(self.config_path.read_text(encoding="utf-8"), str(self.config_path)) or {}
            new = {"recipe": recipe, **to_dict(cfg)}
            # plus the keys a config derives from the world size (lm: train.grad_accum from data.total_batch_tokens)
            allowed = RESUME_MUTABLE | (cfg.resume_mutable() if hasattr(cfg, "resume_mutable") else set())
            defaults = {"recipe": recipe, **to_dict(type(cfg)())}
            changed = config_changes(old, new, allowed | RESUME_WARN, defaults=defaults, same=same or _equal)
            if changed:
                raise ConfigError(
                    f"--resume: the config differs from {self.config_path} at "
                    f"{describe_changes(old, new, changed)}; exact resume needs the same config"
                )
            warn = [k for k in config_changes(old, new, set(), same=same or _equal) if k in RESUME_WARN]
            if warn and not self._warned:
                self._warned = True
                print(
                    f"warning: --resume with {describe_changes(old, new, warn)} (saved in {self.config_path}): "
                    f"on a CPU a different thread count can change the last bits of the results",
                    file=sys.stderr,
                    flush=True,
                )
            return True
        if self.path.exists() and not overwrite:
            if self.exists():
                raise CheckpointError(
                    f"{self.path} already holds a run; pass --resume to continue it or --overwrite to replace it"
                )
            if not self._only_leftovers():
                raise CheckpointError(
                    f"{self.path} is not empty and holds no run (no config.yaml); choose another "
                    f"--out or pass --overwrite to empty it"
                )
        return False

    def prepare(
        self, cfg: Any, recipe: str, *, resume: bool, overwrite: bool, same: Optional[SameValue] = None
    ) -> bool:
        """:meth:`check`, then write ``config.yaml`` and ``meta.json`` (the caller holds :meth:`lock`);
        returns whether the run resumes."""
        resume = self.check(cfg, recipe, resume=resume, overwrite=overwrite, same=same)
        if not resume and self.path.is_dir():  # --overwrite, or leftovers of a killed start
            self.clear()
        self.path.mkdir(parents=True, exist_ok=True)
        resolved = {"recipe": recipe, **to_dict(cfg)}
        atomic_write(self.config_path, yaml.safe_dump(resolved, sort_keys=False))
        meta = (self.read_json("meta.json", missing={}) if resume else None) or {}
        meta.setdefault("starts", []).append(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "argv": sys.argv,
                "git_revision": git_revision(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "host": platform.node(),
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "resume": resume,
            }
        )
        meta["recipe"] = recipe
        meta.setdefault("run_id", uuid.uuid4().hex[:16])  # recorded in every checkpoint (engine.checkpoint)
        meta["git_revision"] = meta["starts"][0]["git_revision"]
        self.write_json("meta.json", meta)
        return resume

    def run_id(self) -> Optional[str]:
        """The run's id from ``meta.json`` (None for runs started before ids were recorded)."""
        try:
            rid = self.read_json("meta.json", missing={}).get("run_id")
        except (CheckpointError, AttributeError):
            return None
        return rid if isinstance(rid, str) else None

    def read_config(self) -> dict:
        if not self.exists():
            raise CheckpointError(f"{self.path} is not a run directory (no config.yaml)")
        data = load_yaml(self.config_path.read_text(encoding="utf-8"), str(self.config_path))
        if not isinstance(data, dict) or "recipe" not in data:
            raise CheckpointError(f"{self.config_path} has no 'recipe' field")
        return data

    def metrics(self) -> list[dict]:
        """All records of ``metrics.jsonl`` (a torn last line of a killed run is skipped)."""
        return _read_jsonl(self.metrics_path)

    def step_logs(self) -> list[Path]:
        """The per-step logs: every top-level ``*.jsonl`` (``metrics.jsonl``, ``samples.jsonl``)."""
        return sorted(p for p in self.path.glob("*.jsonl") if p.is_file())

    def trim_step_logs(self, step: int) -> None:
        """Drop the records logged after ``step``, and torn lines, from every per-step log."""
        for path in self.step_logs():
            keep = [r for r in _read_jsonl(path) if not isinstance(r.get("step"), (int, float)) or r["step"] <= step]
            atomic_write(path, "".join(json.dumps(r) + "\n" for r in keep))


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return [rec for rec in out if isinstance(rec, dict)]
