"""Run untrusted (model-written) Python code in a contained child process.

Design choices:

* **The OS is the containment, the Python prelude is defence in depth.** Each program runs in a
  fresh interpreter (``python -I -S -B -u``: isolated mode, no site-packages, so only the standard
  library is importable) started by :func:`subprocess.Popen` with ``start_new_session=True``.
  A small runner script (written by us, embedded below) sets the limits *inside* the child before
  any untrusted byte runs, so no ``preexec_fn`` is needed and :func:`run_code` is safe to call
  from many threads at once.
* **Layers, strongest first** (which ones applied is reported in :attr:`ExecResult.isolation`):

  1. *Network namespace* (``unshare(CLONE_NEWNET)``; as a non-root user ``CLONE_NEWUSER |
     CLONE_NEWNET``): the child sees only a loopback interface that is down, so no connection can
     reach the host, not even 127.0.0.1. Where the kernel refuses, an audit hook
     (:func:`sys.addaudithook`) refuses every ``socket.*`` event instead.
  2. *Mount namespace*: every mount is re-mounted read-only except the sandbox's own working
     directory, so the program cannot write or delete anything outside it even in
     world-writable places such as ``/tmp`` or ``/dev/shm``. As root this is done before the
     uid is dropped; as a non-root user inside the new user namespace, after which a nested
     user namespace gives up the capabilities, so the program cannot re-mount read-write.
  3. *A dedicated unprivileged uid* (root only): when the parent runs as root (as in containers
     and on this project's test machines), the child drops to a fresh random uid/gid in
     ``[2_000_000_000, 2_100_000_000)`` with no supplementary groups. That is what makes
     ``RLIMIT_NPROC`` bite (it counts the processes of the *uid*, and root ignores it), what makes
     the parent unsignalable (``kill`` across uids fails with EPERM), and what hides
     ``/proc/<parent>/environ``. Because the uid is private to one run, every process left
     behind (a fork bomb's children that escaped the process group with ``setsid``) is found
     through ``/proc`` and killed afterwards. ``PR_SET_NO_NEW_PRIVS`` and a parent-death signal
     are set too. As a non-root user the uid cannot change: the child keeps the caller's uid,
     ``RLIMIT_NPROC`` counts all of the caller's processes, and the prelude (4) is what stops
     signals and writes outside the working directory.
  4. *Resource limits* (``setrlimit``): CPU seconds (``RLIMIT_CPU``, soft = ceil(timeout), hard =
     soft + 1), address space (``RLIMIT_AS``), process count (``RLIMIT_NPROC``), file size
     (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``) and no core dumps (``RLIMIT_CORE = 0``).
  5. *Prelude* ("guard", on by default): an audit hook that refuses process creation, signals,
     ``ctypes``, sockets, and any file write / delete / rename / chmod outside the working
     directory, and replaces ``os.kill``, ``os.fork``, ``os.system``, ``os._exit``, ``os.setsid``
     and friends by functions that raise. Python-level hooks can be bypassed by a determined
     program; layers 1-4 cannot be from inside the child.

* **Fresh filesystem state.** Each run gets a new temporary directory (cwd, ``HOME`` and
  ``TMPDIR``), removed afterwards whatever the program did. The environment is built from
  scratch (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``), so the parent's variables (tokens, keys)
  are never inherited.
* **Wall-clock timeout and bounded output.** The parent reads stdout and stderr incrementally
  with :mod:`selectors`, keeps at most ``max_output_bytes`` in memory, and kills the whole
  process group (and, with a dedicated uid, every process of that uid) when the output cap or the
  wall-clock deadline is passed. Gigabytes of output therefore cost nothing but the time to read
  ``max_output_bytes``.
* **Passing means reaching the end.** ``passed`` is true only when the program ran to its end
  without an uncaught exception; ``sys.exit()`` / ``exit()`` inside the program counts as a
  failure (a HumanEval completion that exits before ``check`` runs must not pass).

Statuses: ``passed``, ``failed`` (exception or non-zero exit), ``timeout`` (wall clock or CPU
limit), ``output_limit`` (more output than allowed), ``error`` (the sandbox itself could not run
the program: interpreter missing, setup failure).
"""

from __future__ import annotations

import json
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
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

__all__ = [
    "ExecResult",
    "run_code",
    "run_many",
    "check_program",
    "build_humaneval_program",
    "UID_RANGE",
]

# A private uid range for sandboxed runs when the parent is root. High enough to stay clear of
# system users, regular users and the usual rootless-container subuid ranges (100000 + 65536*n).
UID_RANGE: tuple[int, int] = (2_000_000_000, 2_100_000_000)

_active_uids: set[int] = set()
_uid_lock = threading.Lock()


@dataclass
class ExecResult:
    """Outcome of one sandboxed program.

    Attributes:
        passed: the program ran to its end without an uncaught exception.
        status: ``passed`` / ``failed`` / ``timeout`` / ``output_limit`` / ``error``.
        returncode: exit status of the child (negative: killed by that signal), None if it never
            started.
        stdout: captured standard output (decoded, truncated to the output cap).
        stderr: captured standard error (decoded, truncated to the output cap).
        duration: wall-clock seconds from start to the end of clean-up.
        reason: one short line saying why it did not pass (empty when it passed).
        truncated: True when output was cut at ``max_output_bytes``.
        isolation: which containment layers applied (``netns``, ``mountns``, ``uid``,
            ``network_layer``, ``guard``, ...) as reported by the child before the program ran.
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


# ----------------------------------------------------------------------------------------------
# The runner executed inside the child. It must only use the standard library (the child runs
# with -I -S) and must set every limit before compiling or running a byte of the program.
_RUNNER_SOURCE = r'''
import json, os, sys

def _map_self(uid, gid):
    # Map our own ids in the new user namespace (allowed without privilege once setgroups is
    # denied), so a nested user namespace can be created later to give up our capabilities.
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                       ("gid_map", "%d %d 1" % (gid, gid))):
        try:
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        except OSError:
            pass

def _setup(cfg):
    import ctypes, resource
    report = {"uid": os.getuid(), "netns": False, "mountns": False, "uid_dropped": False,
              "remount_failures": 0, "guard": bool(cfg["guard"])}
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
    is_root = os.getuid() == 0
    work = cfg["work"]
    if not cfg["allow_network"]:
        flags = CLONE_NEWNET if is_root else (CLONE_NEWUSER | CLONE_NEWNET)
        uid, gid = os.getuid(), os.getgid()
        report["netns"] = libc.unshare(flags) == 0
        if report["netns"] and not is_root:
            _map_self(uid, gid)
    # As root, or as the owner of the new user namespace, we may build a private mount table.
    may_mount = is_root or (report["netns"] and not cfg["allow_network"])
    if not is_root and cfg["allow_network"] and cfg["isolate_fs"]:
        uid, gid = os.getuid(), os.getgid()
        may_mount = libc.unshare(CLONE_NEWUSER) == 0
        if may_mount:
            _map_self(uid, gid)
    if may_mount and cfg["isolate_fs"] and libc.unshare(CLONE_NEWNS) == 0:
        MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
        MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
        # Private propagation first, so nothing we do leaks back into the host's namespace.
        ok = libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
        # The working directory becomes its own mount so it stays writable below.
        ok = ok and libc.mount(work.encode(), work.encode(), None, MS_BIND | MS_REC, None) == 0
        if ok:
            def _unescape(s):
                return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            with open("/proc/self/mountinfo") as f:
                entries = [line.split() for line in f]
            for parts in entries:
                mp, opts = _unescape(parts[4]), parts[5].split(",")
                if mp == work or mp.startswith(work.rstrip("/") + "/"):
                    continue
                fl = MS_REMOUNT | MS_BIND | MS_RDONLY
                fl |= (MS_NOSUID if "nosuid" in opts else 0) | (MS_NODEV if "nodev" in opts else 0)
                fl |= MS_NOEXEC if "noexec" in opts else 0
                if libc.mount(None, mp.encode(), None, fl, None) != 0:
                    report["remount_failures"] += 1
            report["mountns"] = True
            if not is_root:
                # We hold every capability over this mount table (we own its user namespace);
                # a nested user namespace leaves the program none, so it cannot re-mount rw.
                report["mountns"] = libc.unshare(CLONE_NEWUSER) == 0
    lim = cfg["limits"]
    R = resource
    R.setrlimit(R.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1))
    R.setrlimit(R.RLIMIT_AS, (lim["as"], lim["as"]))
    R.setrlimit(R.RLIMIT_FSIZE, (lim["fsize"], lim["fsize"]))
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    R.setrlimit(R.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    if is_root and cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        if os.getuid() != cfg["uid"] or os.geteuid() == 0:
            raise RuntimeError("could not drop privileges")
        report["uid_dropped"] = True
        report["uid"] = os.getuid()
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG = SIGKILL (after setuid, which clears it)
    os.chdir(work)
    return report

def _guard(work, block_sockets, guard):
    import builtins, os
    work = os.path.realpath(work)
    allowed_files = {"/dev/null"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    always = {"os.system", "os.posix_spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
              "signal.pthread_kill", "subprocess.Popen", "pty.spawn", "os.setuid", "os.setgid"}
    prefixes = ("ctypes.", "os.exec", "os.spawn", "socket.")
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.truncate": (0,),
                   "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,),
                   "os.mkdir": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "os.chflags": (0,),
                   "os.setxattr": (0,), "os.removexattr": (0,), "shutil.copyfile": (1,),
                   "shutil.copytree": (1,), "shutil.move": (0, 1)}
    # _posixsubprocess.fork_exec starts processes without an audit event; ctypes reaches libc.
    bad_imports = {"_posixsubprocess", "_ctypes"}
    busy = [False]

    def inside(p):
        if isinstance(p, int):
            return True  # an already-open descriptor: its opening was checked
        p = os.fsdecode(os.fspath(p))
        real = os.path.realpath(os.path.join(os.getcwd(), p))
        return real in allowed_files or real == work or real.startswith(work + os.sep)

    def hook(event, args):
        if busy[0]:
            return
        busy[0] = True
        try:
            if event.startswith("socket.") and block_sockets:
                raise PermissionError("sandbox: network access is disabled")
            if not guard:
                return
            if event in always or event.startswith(prefixes):
                raise PermissionError("sandbox: %s is not allowed" % event)
            if event == "import" and args[0] in bad_imports:
                raise ImportError("sandbox: importing %s is not allowed" % args[0])
            if event == "open":
                path, mode, flags = args
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                          (isinstance(flags, int) and flags & write_flags)
                if writing and path is not None and not inside(path):
                    raise PermissionError("sandbox: writing outside the working directory: %r" % (path,))
            elif event in path_events:
                for i in path_events[event]:
                    if i < len(args) and args[i] is not None and not inside(args[i]):
                        raise PermissionError("sandbox: %s outside the working directory: %r" % (event, args[i]))
        finally:
            busy[0] = False

    sys.addaudithook(hook)
    if guard:
        def refuse(*a, **k):
            raise PermissionError("sandbox: this operation is disabled")
        for name in ("kill", "killpg", "system", "fork", "forkpty", "_exit", "setsid", "setpgid",
                     "setpgrp", "putenv", "unsetenv", "chroot", "setuid", "setgid", "nice",
                     "execv", "execve", "execvp", "execvpe", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                setattr(os, name, refuse)

def _main():
    cfg_path, status_fd = sys.argv[1], int(sys.argv[2])
    with open(cfg_path) as f:
        cfg = json.load(f)
    try:
        report = _setup(cfg)
    except BaseException as exc:
        os.write(status_fd, json.dumps({"setup_error": repr(exc)}).encode())
        os.close(status_fd)
        sys.exit(97)
    block_sockets = not cfg["allow_network"] and not report["netns"]
    report["network_layer"] = ("allowed" if cfg["allow_network"] else
                               "netns" if report["netns"] else "audit-hook")
    os.write(status_fd, json.dumps(report).encode())
    os.close(status_fd)  # the program cannot forge the report
    with open(cfg["program"], encoding="utf-8") as f:
        source = f.read()
    code = compile(source, cfg["program"], "exec")
    _guard(cfg["work"], block_sockets, cfg["guard"])
    glb = {"__name__": "__main__", "__file__": cfg["program"], "__builtins__": __builtins__}
    try:
        exec(code, glb)
    except SystemExit as exc:
        sys.stderr.write("sandbox: the program called exit(%r) before its end\n" % (exc.code,))
        sys.exit(3)
    sys.stdout.flush()

_main()
'''


_python_cache: dict[bool, Optional[str]] = {}


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


def _interpreter_ok(exe: str, for_other_uid: bool) -> bool:
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return False
    if not for_other_uid:
        return True
    try:
        out = subprocess.run([exe, "-I", "-S", "-c", "import sys, json; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, timeout=20, env={"PATH": "/usr/bin:/bin"})
        paths = json.loads(out.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False
    stdlib = [p for p in paths if p and os.path.isdir(p)]
    return (_world_readable(exe) and bool(stdlib) and all(_world_readable(p) for p in stdlib))


def _isolated_python(for_other_uid: bool) -> Optional[str]:
    """An interpreter whose standard library the sandbox can read.

    With ``-S`` a venv adds nothing, so the real interpreter behind :data:`sys.executable` is
    used. When the sandbox runs under another uid, that interpreter's files must be readable by
    it (a pyenv build under ``/root`` is not): then the system's ``python3.X`` of the same
    version, then any ``python3``, is tried. Cached per process.
    """
    if for_other_uid in _python_cache:
        return _python_cache[for_other_uid]
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [os.path.realpath(sys.executable), f"/usr/bin/python{ver}",
                  f"/usr/local/bin/python{ver}", "/usr/bin/python3", "/usr/local/bin/python3"]
    found = next((c for c in candidates if _interpreter_ok(c, for_other_uid)), None)
    _python_cache[for_other_uid] = found
    return found


def _acquire_uid() -> int:
    with _uid_lock:
        while True:
            uid = random.randrange(*UID_RANGE)
            if uid not in _active_uids:
                _active_uids.add(uid)
                return uid


def _release_uid(uid: Optional[int]) -> None:
    if uid is not None:
        with _uid_lock:
            _active_uids.discard(uid)


def _pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real, effective or saved uid is ``uid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                text = f.read()
        except OSError:
            continue
        uids = state = None
        for line in text.splitlines():
            if line.startswith("Uid:"):
                uids = line.split()[1:4]
            elif line.startswith("State:"):
                state = line.split()[1]
        if uids and str(uid) in uids and state != "Z":
            pids.append(int(name))
    return pids


def _kill_uid(uid: int, rounds: int = 200) -> int:
    """SIGKILL every process of a dedicated sandbox uid until none is left; returns the count."""
    if uid in (0, os.getuid()) or not (UID_RANGE[0] <= uid < UID_RANGE[1]):
        raise RuntimeError(f"refusing to kill processes of uid {uid}: not a sandbox uid")
    killed = 0
    for _ in range(rounds):
        pids = _pids_of_uid(uid)
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


def run_code(code: str, timeout: float = 5.0, memory_mb: int = 512,
             max_output_bytes: int = 1_000_000, *, max_processes: int = 8,
             max_file_mb: int = 16, max_open_files: int = 64, guard: bool = True,
             allow_network: bool = False, isolate_fs: bool = True,
             drop_privileges: bool = True, python: Optional[str] = None) -> ExecResult:
    """Run ``code`` as a ``__main__`` module in a contained child process.

    Args:
        code: Python source to run (standard library only).
        timeout: wall-clock limit in seconds; the CPU limit is ``ceil(timeout)`` seconds.
        memory_mb: address-space limit of the child (``RLIMIT_AS``), in MiB.
        max_output_bytes: stdout + stderr kept; more output kills the program (``output_limit``).
        max_processes: ``RLIMIT_NPROC`` (processes and threads of the sandbox uid).
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``), in MiB.
        max_open_files: ``RLIMIT_NOFILE``.
        guard: install the Python prelude (audit hook + disabled ``os`` functions).
        allow_network: keep the host network (off by default).
        isolate_fs: when root, re-mount everything but the working directory read-only.
        drop_privileges: when root, run under a fresh unprivileged uid (strongly recommended).
        python: interpreter to use; defaults to the real path of :data:`sys.executable`.

    Returns:
        An :class:`ExecResult`; never raises for anything the program does.
    """
    if timeout <= 0 or memory_mb <= 0 or max_output_bytes < 0 or max_processes < 1:
        raise ValueError("run_code: timeout, memory_mb and max_processes must be positive, "
                         f"got timeout={timeout}, memory_mb={memory_mb}, "
                         f"max_processes={max_processes}, max_output_bytes={max_output_bytes}")
    start = time.monotonic()
    is_root = os.getuid() == 0
    uid = _acquire_uid() if (is_root and drop_privileges) else None
    base = tempfile.mkdtemp(prefix="lapheads-sandbox-")
    proc: Optional[subprocess.Popen] = None
    status_r = status_w = -1
    try:
        os.chmod(base, 0o755)  # the sandbox uid reads runner/config/program, cannot write here
        work = os.path.join(base, "work")
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
        program = os.path.join(base, "program.py")
        runner = os.path.join(base, "runner.py")
        config = os.path.join(base, "config.json")
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        with open(runner, "w", encoding="utf-8") as f:
            f.write(_RUNNER_SOURCE)
        cfg = {"work": work, "program": program, "uid": uid, "gid": uid, "guard": guard,
               "allow_network": allow_network, "isolate_fs": isolate_fs,
               "limits": {"cpu": max(1, math.ceil(timeout)), "as": int(memory_mb) << 20,
                          "fsize": int(max_file_mb) << 20, "nofile": int(max_open_files),
                          "nproc": int(max_processes)}}
        with open(config, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        for p in (program, runner, config):
            os.chmod(p, 0o644)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8"}
        exe = python or _isolated_python(uid is not None)
        if exe is None:
            return ExecResult(False, "error", None, "", "", time.monotonic() - start,
                              reason="no Python interpreter whose standard library an unprivileged "
                                     "uid can read; pass python=... or drop_privileges=False")
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [exe, "-I", "-S", "-B", "-u", runner, config, str(status_w)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=work, env=env, start_new_session=True, close_fds=True, pass_fds=(status_w,))
        except OSError as exc:
            return ExecResult(False, "error", None, "", "", time.monotonic() - start,
                              reason=f"could not start the interpreter: {exc}")
        finally:
            os.close(status_w)
        return _collect(proc, status_r, uid, start, timeout, max_output_bytes)
    finally:
        if proc is not None:
            _kill_group(proc.pid)
            if uid is not None:
                _kill_uid(uid)
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        if status_r >= 0:
            try:
                os.close(status_r)
            except OSError:
                pass
        _release_uid(uid)
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


def _collect(proc: subprocess.Popen, status_r: int, uid: Optional[int], start: float,
             timeout: float, cap: int) -> ExecResult:
    """Read the child's pipes until it ends, the deadline passes or the output cap is reached."""
    deadline = start + timeout
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(status_r, selectors.EVENT_READ, "status")
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
                # The main process is gone; a descendant may still hold the pipes open.
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
                if name == "status":
                    bufs[name] += chunk[:65536 - len(bufs[name])]
                    continue
                room = cap - total
                bufs[name] += chunk[:max(room, 0)]
                total += len(chunk)
                if total > cap:
                    over_cap = True
            if over_cap:
                break
    finally:
        sel.close()
    _kill_group(proc.pid)
    if uid is not None:
        _kill_uid(uid)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    rc = proc.returncode
    stdout = bufs["stdout"].decode("utf-8", "replace")
    stderr = bufs["stderr"].decode("utf-8", "replace")
    try:
        isolation = json.loads(bufs["status"].decode() or "{}")
    except ValueError:
        isolation = {}
    duration = time.monotonic() - start

    def result(status: str, reason: str) -> ExecResult:
        return ExecResult(status == "passed", status, rc, stdout, stderr, duration, reason,
                          over_cap, isolation)

    if "setup_error" in isolation:
        return result("error", f"sandbox setup failed: {isolation['setup_error']}")
    if not isolation:
        return result("error", f"the sandbox runner did not start (exit {rc}): {stderr.strip()[-300:]}")
    if over_cap:
        return result("output_limit", f"more than {cap} bytes of output")
    if timed_out:
        return result("timeout", f"wall-clock limit of {timeout:g} s")
    if rc == -signal.SIGXCPU:
        return result("timeout", "CPU-time limit")
    if rc == 0:
        return result("passed", "")
    if rc is not None and rc < 0:
        return result("failed", f"killed by {signal.Signals(-rc).name}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {rc}"
    return result("failed", last[:300])


def run_many(codes: Sequence[str], workers: int = 2, progress: bool = False,
             **kwargs: Any) -> list[ExecResult]:
    """Run several programs with a thread pool (each in its own sandbox); order is kept.

    Args:
        codes: the programs.
        workers: concurrent sandboxes (each one is a process; threads only wait on pipes).
        progress: show a tqdm bar.
        **kwargs: passed to :func:`run_code`.
    """
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        it: Iterable[ExecResult] = pool.map(lambda c: run_code(c, **kwargs), codes)
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(it, total=len(codes), desc="sandbox", leave=False)
        return list(it)


def build_humaneval_program(problem_prompt: str, completion: str, test: str,
                            entry_point: str) -> str:
    """The program HumanEval runs: prompt + completion + test + ``check(entry_point)``.

    Args:
        problem_prompt: the problem's prompt (imports, signature and docstring).
        completion: the function body continuing the prompt.
        test: the problem's test code defining ``check(candidate)``.
        entry_point: the name of the function under test.
    """
    return f"{problem_prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"


def check_program(problem_prompt: str, completion: str, test: str, entry_point: str,
                  timeout: float = 5.0, **kwargs: Any) -> ExecResult:
    """Build the HumanEval program for one completion and run it in the sandbox.

    Args:
        problem_prompt: the problem's prompt.
        completion: the model's continuation of the prompt.
        test: the problem's ``check`` function source.
        entry_point: the function under test.
        timeout: wall-clock seconds.
        **kwargs: passed to :func:`run_code`.
    """
    return run_code(build_humaneval_program(problem_prompt, completion, test, entry_point),
                    timeout=timeout, **kwargs)
