"""Run-directory integrity under real processes: one writer, signals, sweeps that never mix settings.

Design choices:

* Every command runs as a real child process of a fork server (tests/_reliability_helpers), which
  imported torch/timm/lapheads once, with one intra-op thread; stdout and stderr are separate
  files, so "one stderr line" is checked exactly.
* The signal tests stop a tiny digits run right after it logged its first step: the run has ten
  times more steps than it can do before the signal lands, and no periodic checkpoints, so the
  checkpoint the message names can only have been written by the interruption. The printed
  resume command is then run as printed and must finish with one record per step.
* The sweep tests use 2-step runs; what they check is which runs are trained, skipped, restarted
  or refused, and that a refusal changes nothing on disk.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from _reliability_helpers import (
    DIGITS,
    TINY,
    ForkServer,
    check_checkpoint_dir,
    classify_argv,
    snapshot,
    subprocess_env,
    train_steps,
)

STEPS = 150


@pytest.fixture(scope="module")
def server():
    srv = ForkServer(subprocess_env())
    yield srv
    srv.close()


def _lines(path: Path) -> list[str]:
    return path.read_text().strip().splitlines() if path.is_file() else []


def _wait_for_first_step(server: ForkServer, pid: int, run: Path, err: Path) -> None:
    deadline = time.time() + 180
    while time.time() < deadline:
        if _lines(run / "metrics.jsonl"):
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise AssertionError(f"the run ended before its first step: {err.read_text()[-2000:]}") from None
        time.sleep(0.005)
    raise AssertionError("no training step within 180 s")


def _tb_steps(tb: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _interrupt_and_resume(server: ForkServer, tmp_path: Path, sig: signal.Signals, second_writer: bool) -> None:
    run = tmp_path / "run"
    argv = classify_argv(run, "--set", f"train.max_steps={STEPS}", "--set", "train.ckpt_every=0")
    pid = server.start(argv, tmp_path / "first.out", tmp_path / "first.err")
    _wait_for_first_step(server, pid, run, tmp_path / "first.err")

    if second_writer:  # a second terminal (or a restarted job) resumes the same directory
        before = snapshot(run / "checkpoints")
        other = server.start(argv + ["--resume"], tmp_path / "second.out", tmp_path / "second.err")
        assert server.wait(other) == 2, (tmp_path / "second.err").read_text()
        err = _lines(tmp_path / "second.err")
        assert len(err) == 1, err
        assert err[0].startswith("lapheads train classify: error: ") and "being written by another process" in err[0]
        assert f"PID {pid} on host {platform.node()}" in err[0], err[0]
        os.kill(pid, 0)  # the first run is unharmed and still training
        assert not snapshot(run / "checkpoints") or snapshot(run / "checkpoints") == before

    os.kill(pid, sig)
    rc = server.wait(pid)
    err = _lines(tmp_path / "first.err")
    assert rc == 128 + sig, (rc, err)
    assert len(err) == 1, err
    head = f"lapheads train classify: interrupted by {sig.name} after step "
    assert err[0].startswith(head), err[0]
    step = int(err[0][len(head) :].split()[0])
    assert 1 <= step < STEPS
    ck = run / "checkpoints" / f"step_{step:08d}"
    assert f"checkpoint {ck} is complete" in err[0], err[0]
    assert check_checkpoint_dir(run / "checkpoints") == step  # complete, readable, the step it names
    assert not (run / ".lock").exists()

    cmd = shlex.split(err[0].split("; resume with: ", 1)[1])
    assert cmd[:3] == ["lapheads", "train", "classify"] and cmd[-1] == "--resume", cmd
    assert cmd[3:-1] == argv[2:], "the resume command repeats the original flags"
    pid = server.start(cmd[1:], tmp_path / "resume.out", tmp_path / "resume.err")
    assert server.wait(pid) == 0, (tmp_path / "resume.err").read_text()[-3000:]
    assert (run / "final" / "model.json").is_file()
    assert train_steps(run) == list(range(1, STEPS + 1))  # one record per step, none twice
    assert _tb_steps(run / "tb") == list(range(1, STEPS + 1))  # one TensorBoard curve


def test_sigterm_stops_at_a_step_with_a_checkpoint_and_a_resume_command(server, tmp_path):
    _interrupt_and_resume(server, tmp_path, signal.SIGTERM, second_writer=True)


def test_sigint_stops_at_a_step_with_a_checkpoint_and_a_resume_command(server, tmp_path):
    _interrupt_and_resume(server, tmp_path, signal.SIGINT, second_writer=False)


# ----------------------------------------------------------------------------- sweeps
def _sweep(
    server: ForkServer, tmp_path: Path, name: str, out: Path, *extra: str, heads: str = "0"
) -> tuple[int, str, list[str]]:
    argv = [
        "sweep",
        "--config",
        DIGITS,
        "--laplacian-heads",
        heads,
        "--seeds",
        "0",
        "--out",
        str(out),
        "--no-report",
        *TINY,
        "--set",
        "train.max_steps=2",
        *extra,
    ]
    pid = server.start(argv, tmp_path / f"{name}.out", tmp_path / f"{name}.err")
    rc = server.wait(pid)
    return rc, (tmp_path / f"{name}.out").read_text(), _lines(tmp_path / f"{name}.err")


def _lr(run: Path) -> float:
    return yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"]


def test_sweep_never_mixes_settings(server, tmp_path):
    out = tmp_path / "sweep"
    rc, log, err = _sweep(server, tmp_path, "first", out)
    assert rc == 0, err
    run = out / "lap0_seed0"
    assert (run / "final" / "model.json").is_file() and _lr(run) == 0.002

    # a changed setting: one line listing the run and the key, nothing touched
    before = snapshot(out)
    rc, log, err = _sweep(server, tmp_path, "changed", out, "--set", "optim.lr=0.5")
    assert rc == 2 and len(err) == 1, err
    assert "lap0_seed0" in err[0] and "optim.lr" in err[0] and "--restart-changed" in err[0], err[0]
    assert "train.max_steps" not in err[0] and "train.log_every" not in err[0]
    assert snapshot(out) == before

    # keys that do not change the math may differ: the finished run is reused
    rc, log, err = _sweep(server, tmp_path, "cosmetic", out, "--set", "train.log_every=2")
    assert rc == 0 and "lap0_seed0: finished, skipped" in log, (log, err)
    # the run length decides a finished run's model: refused
    rc, log, err = _sweep(server, tmp_path, "longer", out, "--set", "train.max_steps=3")
    assert rc == 2 and "train.max_steps" in err[0], err

    # --restart-changed trains the changed run afresh; a directory left by a start killed while
    # writing its first config.yaml (only the temporary file) is not a run and simply starts
    wedged = out / "lap2_seed0"
    wedged.mkdir()
    (wedged / f".config.yaml.tmp-{os.getpid()}").write_text("recipe: classify\nmod")
    rc, log, err = _sweep(server, tmp_path, "restart", out, "--set", "optim.lr=0.5", "--restart-changed", heads="0,2")
    assert rc == 0, err
    assert re.search(r"lap0_seed0: .*optim\.lr", log), log  # the run that was restarted, and the key that changed
    assert _lr(run) == 0.5 and _lr(wedged) == 0.5 and (wedged / "final" / "model.json").is_file()
    assert not list(wedged.glob(".config.yaml.tmp-*"))

    # the same --overwrite as `lapheads train`: every run starts afresh
    rc, log, err = _sweep(server, tmp_path, "overwrite", out, "--set", "optim.lr=0.5", "--overwrite", heads="0,2")
    assert rc == 0, err
    assert log.count("deleted to start afresh (--overwrite)") == 2 and "skipped" not in log, log
    assert not (out / ".lock").exists() and not (run / ".lock").exists()

    # the quickstart reuses runs the same way: a run made with other settings stops it before
    # anything trains
    qs = tmp_path / "qs"
    (qs / "vision").mkdir(parents=True)
    shutil.copytree(run, qs / "vision" / "lap0_seed0")
    before = snapshot(qs)
    pid = server.start(["quickstart", "--tiny", "--no-lm", "--out", str(qs)], tmp_path / "qs.out", tmp_path / "qs.err")
    assert server.wait(pid) == 2
    err = _lines(tmp_path / "qs.err")
    assert len(err) == 1 and "lap0_seed0" in err[0] and "train.max_steps" in err[0] and "--overwrite" in err[0], err
    assert snapshot(qs) == before


def test_eval_classify_into_a_run_takes_its_writer_lock(tmp_path, capsys):
    """eval classify writes RUN/final/eval.json: refused in one line while another process holds the
    run, written once it is free."""
    import subprocess

    from lapheads.cli import main as cli

    run = tmp_path / "run"
    assert cli(classify_argv(run, "--set", "train.max_steps=2")) == 0
    code = (
        "import sys; from lapheads.engine.run import RunLock; RunLock.acquire(sys.argv[1]); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert cli(["eval", "classify", "--checkpoint", str(run)]) == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
        assert not (run / "final" / "eval.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert cli(["eval", "classify", "--checkpoint", str(run)]) == 0
    assert (run / "final" / "eval.json").is_file()
