"""Distributed faults under a real 2-process torchrun (gloo): SIGTERM to torchrun, SIGKILL of one
rank, and the resumes that follow, in ONE run that is then compared with an uninterrupted one.

Design choices:

* Nothing is added to the product: the test finds rank 1's worker in the process tree of the
  torchrun command (``/proc/<pid>/environ`` holds ``RANK=1``) and sends it SIGKILL.
* One run goes through both faults (each torchrun launch costs ~10 s of imports on 2 cores, so the
  two scenarios share the reference run and the launches between them):
  1. SIGTERM to torchrun right after the first logged step. torchrun forwards it to every rank, the
     ranks agree on the step, rank 0 writes the checkpoint and prints one line with the resume
     command. Periodic checkpoints come every ``CKPT_EVERY`` steps, later than the signal lands, so
     the checkpoint the line names can only have been written by the interruption.
  2. The printed command, run as printed; rank 1's worker is SIGKILLed right after the next periodic
     checkpoint. ``LAPHEADS_DIST_TIMEOUT=20`` bounds every collective of the surviving rank and
     torchrun's elastic agent tears the group down: the command must end non-zero well within 90 s
     and name the failed rank.
  3. ``--resume`` with 2 processes continues from the newest complete checkpoint; the final weights
     equal an uninterrupted 2-process run bit for bit (gloo on the CPU is deterministic) and every
     step is logged once.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _reliability_helpers import (
    check_checkpoint_dir,
    classify_argv,
    same_weights,
    subprocess_env,
    torchrun,
    train_steps,
)

STEPS = 30
CKPT_EVERY = 12
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]


def _cmd(out: Path, *extra: str) -> list[str]:
    return torchrun(
        "--nproc_per_node=2",
        "-m",
        "lapheads.cli",
        *classify_argv(
            out,
            "--set",
            f"train.max_steps={STEPS}",
            "--set",
            f"train.ckpt_every={CKPT_EVERY}",
            "--set",
            "data.batch_size=8",
            *extra,
        ),
    )


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


def _metrics(run: Path) -> list[str]:
    path = run / "metrics.jsonl"
    return path.read_text().strip().splitlines() if path.is_file() else []


def _latest_step(run: Path) -> int:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("_")[1]) if latest.is_file() else 0


def test_sigterm_then_killed_rank_then_resume_equals_uninterrupted(tmp_path):
    env = subprocess_env(LAPHEADS_DIST_TIMEOUT="20")
    ref = tmp_path / "ref"
    r = subprocess.run(_cmd(ref), env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]

    # 1. SIGTERM to torchrun after the first step: one line, a checkpoint at that step, a resume command
    run = tmp_path / "run"
    p = subprocess.Popen(_cmd(run), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not _metrics(run):
            assert p.poll() is None and time.time() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    ours = [line for line in err.splitlines() if line.startswith("lapheads train classify:")]
    assert len(ours) == 1 and "interrupted by SIGTERM after step " in ours[0], err[-3000:]
    stopped = int(ours[0].split("after step ")[1].split()[0])
    assert stopped < CKPT_EVERY, f"the signal landed late (step {stopped}): the checkpoint may be a periodic one"
    assert check_checkpoint_dir(run / "checkpoints") == stopped
    cmd = shlex.split(ours[0].split("; resume with: ", 1)[1])
    assert cmd[:3] == ["torchrun", "--nproc_per_node=2", "-m"] and cmd[-1] == "--resume", cmd

    # 2. the printed command, as printed; rank 1 SIGKILLed after the next periodic checkpoint
    log = open(tmp_path / "faulty.log", "w+")
    proc = subprocess.Popen(torchrun(*cmd[1:]), env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while _latest_step(run) <= stopped:
            assert proc.poll() is None and time.time() < deadline, "the resumed run ended before its next checkpoint"
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
    assert rc != 0, text[-3000:]  # and it ended: proc.wait(timeout=90) above raises on a hang
    # the failure names the dead rank and its signal (torchrun's summary), not a hang
    assert "rank" in text and ("SIGKILL" in text or "-9" in text), text[-3000:]
    assert not (run / "final").exists()
    step = check_checkpoint_dir(run / "checkpoints")
    assert step is not None and stopped < step < STEPS

    # 3. resume to the end: the uninterrupted run's weights, every step logged once
    r = subprocess.run(_cmd(run, "--resume"), env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert same_weights(ref / "final" / "model.safetensors", run / "final" / "model.safetensors")
    assert train_steps(run) == list(range(1, STEPS + 1))
