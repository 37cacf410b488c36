"""Crash-safe exact resume: SIGKILL a CPU training run at random moments, resume, compare bits.

Design choices:

* The runs are children of a fork server (tests/_reliability_helpers.ForkServer) that imported
  torch/timm/lapheads once: every attempt is still a real process killed with SIGKILL, but the
  test does not pay an interpreter start per kill. The server's fsync helpers sleep a little, so
  a checkpoint write lasts long enough for some kills to land inside it (proved afterwards by
  the ``.tmp-*`` directory the killed writer left behind).
* Kill schedule (seeded): the first kill lands after ``config.yaml`` exists but before the first
  checkpoint (resume must then start from step 0); the rest alternate between "during a
  checkpoint write" (kill a random few ms after a ``.tmp-*`` directory appears) and "anywhere"
  (a random delay after the attempt starts training).
* After every kill: ``latest`` names a complete checkpoint whose every file loads. At the end:
  ``final/model.safetensors`` is bit-identical to an uninterrupted run with the same seed,
  ``metrics.jsonl`` holds exactly one train record per step, and no partial directory is left.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from _reliability_helpers import (
    ForkServer,
    check_checkpoint_dir,
    classify_argv,
    same_weights,
    subprocess_env,
    train_steps,
)

STEPS, CKPT_EVERY = 60, 3
MIN_KILLS, MIN_IN_WRITE = 10, 3


def _argv(out: Path, resume: bool) -> list[str]:
    return classify_argv(
        out,
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        f"train.ckpt_every={CKPT_EVERY}",
        "--set",
        "train.keep_checkpoints=2",
        *(["--resume"] if resume else []),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _tmp_dirs(ckpt: Path) -> list[str]:
    try:
        return [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]
    except FileNotFoundError:
        return []


def _n_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return -1


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path):
    server = ForkServer(subprocess_env(), fsync_delay=0.03)
    try:
        ref = tmp_path / "ref"
        pid = server.start(_argv(ref, False), tmp_path / "ref.log")
        assert server.wait(pid) == 0, (tmp_path / "ref.log").read_text()[-3000:]

        run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
        rng = random.Random(20240611)
        kills = in_write = before_first = 0
        finished = False
        for attempt in range(40):
            if kills >= MIN_KILLS + 2 and in_write >= MIN_IN_WRITE:
                break
            resume = (run / "config.yaml").is_file()
            lines0 = _n_lines(run / "metrics.jsonl")
            pid = server.start(_argv(run, resume), tmp_path / f"attempt{attempt}.log")
            mode = "before_first" if attempt == 0 else ("write" if attempt % 2 else "anywhere")
            deadline = time.time() + 120
            while _alive(pid) and time.time() < deadline:
                if mode == "before_first":
                    if (run / "config.yaml").is_file():
                        break
                elif mode == "write":
                    if _tmp_dirs(ckpt):
                        time.sleep(rng.uniform(0.0, 0.12))
                        break
                # "anywhere": once this attempt trains (metrics.jsonl changed), a random delay
                elif _n_lines(run / "metrics.jsonl") != lines0:
                    time.sleep(rng.uniform(0.0, 0.6))
                    break
                time.sleep(0.002)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            status = server.wait(pid)
            if status == 0:  # the run finished before the kill landed
                finished = True
                break
            assert status == -signal.SIGKILL, (status, (tmp_path / f"attempt{attempt}.log").read_text()[-3000:])
            kills += 1
            step = check_checkpoint_dir(ckpt)  # `latest` never names a partial checkpoint
            if mode == "before_first" and step is None:
                before_first += 1
            if _tmp_dirs(ckpt):  # the killed process was inside write_checkpoint
                in_write += 1
        if not finished:
            pid = server.start(_argv(run, True), tmp_path / "last.log")
            assert server.wait(pid) == 0, (tmp_path / "last.log").read_text()[-3000:]
    finally:
        server.close()

    print(
        f"\nSIGKILL resume: {kills} kills survived ({in_write} inside a checkpoint write, "
        f"{before_first} before the first checkpoint)"
    )
    assert kills >= MIN_KILLS, f"only {kills} kills landed before the run finished"
    assert in_write >= MIN_IN_WRITE, f"only {in_write} kills landed inside a checkpoint write"
    assert before_first == 1
    assert same_weights(ref / "final" / "model.safetensors", run / "final" / "model.safetensors")
    assert train_steps(run) == list(range(1, STEPS + 1)) == train_steps(ref)
    assert check_checkpoint_dir(ckpt) == STEPS
    assert not _tmp_dirs(ckpt) and not list(run.glob(".*tmp*")) and not list(ckpt.glob(".*tmp*"))
