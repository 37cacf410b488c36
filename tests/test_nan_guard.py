"""NaN / Inf through the CLI: injected and real non-finite values stop the run with one clear line
(or skip the step when configured), and the last good checkpoint stays intact.

Design choices:

* In-process ``lapheads.cli.main`` on the tiny digits classifier (a few seconds per run).
* The stop message must name the step and the first non-finite tensor; exit status is 1 (not 2:
  the input was valid, the numbers were not), with no traceback unless ``--debug``.
* A real (not injected) blow-up: ``optim.lr=1e30`` with plain SGD and no clipping overflows the
  weights after the first update, so the next forward pass is non-finite.
"""

from __future__ import annotations

import json

import pytest
import torch
from _reliability_helpers import check_checkpoint_dir, classify_argv, train_steps

from lapheads.cli import main as cli
from lapheads.engine.checkpoint import latest_checkpoint, load_tensors
from lapheads.errors import NonFiniteError
from lapheads.testing import NAN_AT_STEP


def _run(out, capsys, *extra):
    capsys.readouterr()
    rc = cli(classify_argv(out, "--set", "train.ckpt_every=2", *extra))
    return rc, capsys.readouterr().err


def test_injected_nan_stops_with_one_line_and_keeps_last_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(NAN_AT_STEP, "5")  # the test hook (lapheads.testing), not part of any config
    out = tmp_path / "nan"
    rc, err = _run(out, capsys, "--set", "train.max_steps=8")
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("lapheads train classify: error: non-finite value at step 5: the loss is NaN/Inf")
    assert "step_00000004" in lines[0]  # names the last good checkpoint
    assert check_checkpoint_dir(out / "checkpoints") == 4  # intact: loads, finite, consistent
    assert train_steps(out) == [1, 2, 3, 4, 5]
    assert not (out / "final").exists()
    # resuming restarts from step 4 and stops again at the same step: nothing was corrupted
    rc, err = _run(out, capsys, "--set", "train.max_steps=8", "--resume")
    assert rc == 1 and "step 5" in err
    # with --debug the exception (and its traceback) comes through
    with pytest.raises(NonFiniteError, match="step 5"):
        cli(classify_argv(out, "--set", "train.ckpt_every=2", "--set", "train.max_steps=8", "--resume", "--debug"))


def test_skip_policy_finishes_and_logs_the_skip(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(NAN_AT_STEP, "2")
    out = tmp_path / "skip"
    rc, err = _run(out, capsys, "--set", "train.max_steps=6", "--set", "train.nan_policy=skip")
    assert rc == 0, err
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in recs if r.get("skipped_nonfinite")]
    assert skips == [{"step": 3, "skipped_nonfinite": 1, "what": "the loss"}]
    assert train_steps(out) == [1, 2, 4, 5, 6]
    sd = load_tensors(out / "final" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert torch.load(latest_checkpoint(out / "checkpoints") / "state.pt", weights_only=True)["skipped"] == 1


def test_real_overflow_is_caught_with_a_clear_message(tmp_path, capsys):
    out = tmp_path / "blowup"
    rc, err = _run(
        out,
        capsys,
        "--set",
        "train.max_steps=6",
        "--set",
        "optim.name=sgd",
        "--set",
        "optim.lr=1e30",
        "--set",
        "optim.lr_batch=0",
        "--set",
        "train.clip_grad=0",
        "--set",
        "train.warmup_ratio=0",
        "--set",
        "train.schedule=constant",
        "--set",
        "train.ckpt_every=1",
    )
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    # step 0's update makes the weights ~1e30 (finite); step 1's forward pass overflows
    assert "error:" in lines[0] and "step 1" in lines[0] and "loss" in lines[0], lines[0]
    assert "step_00000001" in lines[0]
    assert check_checkpoint_dir(out / "checkpoints") == 1  # the checkpoint it names is finite and loads
