"""Distributed faults: kill one rank of a 2-process torchrun (gloo) run, then resume.

Design choices:

* Nothing is added to the product: the test finds rank 1's worker in the process tree of the
  torchrun command (``/proc/<pid>/environ`` holds ``RANK=1``) and sends it SIGKILL right after
  the first checkpoint appears.
* ``LAPHEADS_DIST_TIMEOUT=20`` bounds every collective of the surviving rank; torchrun's elastic
  agent also notices the dead worker and tears the group down. The whole command must end with a
  non-zero status well within 90 s, and its output must name the failed rank.
* ``--resume`` with 2 processes continues from the newest complete checkpoint and its final
  weights equal an uninterrupted 2-process run bit for bit (gloo on the CPU is deterministic).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _reliability_helpers import check_checkpoint_dir, classify_argv, same_weights, subprocess_env, train_steps

STEPS = 30
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]


def _free_port() -> int:
    # (--master_port=0 made the workers dial 127.0.0.1:0 and time out in this torch version)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
            "-m", "lapheads.cli", *classify_argv(out, "--set", f"train.max_steps={STEPS}", "--set", "train.ckpt_every=3",
                                                 "--set", "data.batch_size=8", *extra)]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(d))
    return out


def _worker_of_rank(root: int, rank: int) -> int | None:
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=%d" % rank in env and pid != root:
            return pid
        todo += _children(pid)
    return None


def test_killed_rank_ends_the_run_and_resume_finishes(tmp_path):
    env = subprocess_env(LAPHEADS_DIST_TIMEOUT="20")
    ref = tmp_path / "ref"
    r = subprocess.run(_cmd(ref), env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]

    run = tmp_path / "run"
    log = open(tmp_path / "faulty.log", "w+")
    proc = subprocess.Popen(_cmd(run), env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not (run / "checkpoints" / "latest").is_file():
            assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.01)
        victim = _worker_of_rank(proc.pid, 1)
        assert victim is not None, "rank 1's worker process not found"
        os.kill(victim, signal.SIGKILL)
        t_kill = time.time()
        rc = proc.wait(timeout=90)
        elapsed = time.time() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    print(f"\nrank 1 SIGKILLed: torchrun exited with {rc} after {elapsed:.1f} s")
    assert rc != 0, text[-3000:]
    assert elapsed < 90
    # the failure names the dead rank and its signal (torchrun's summary), not a hang
    assert "rank" in text and ("SIGKILL" in text or "-9" in text), text[-3000:]
    assert not (run / "final").exists()
    step = check_checkpoint_dir(run / "checkpoints")
    assert step is not None and step < STEPS

    r = subprocess.run(_cmd(run, "--resume"), env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert same_weights(ref / "final" / "model.safetensors", run / "final" / "model.safetensors")
    assert train_steps(run) == list(range(1, STEPS + 1))
