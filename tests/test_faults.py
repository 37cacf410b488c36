"""Faults a long run meets: a full disk, damaged checkpoints, resuming from the run directory alone.

Design choices:

* One uninterrupted reference run (tiny digits classify model, 6 steps, a checkpoint every 2,
  all kept) is trained once per module; every damaged-checkpoint case works on a copy of it with
  its newest checkpoint and ``final/`` removed (as a kill after step 4 would leave it), so the
  resumed run must end bit-identical to the reference's ``final/model.safetensors``.
* Full-disk cases put the run directory on a small tmpfs (needs root and ``mount``; skipped with
  the reason elsewhere), sized from the reference run's checkpoint so the case is deterministic.
* Each error is checked for its key facts (the path, the step, the byte counts), never for whole
  sentences, and for one line without a traceback; no test asserts a wall-clock time.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _reliability_helpers import classify_argv

from lapheads.cli import main as cli
from lapheads.engine.checkpoint import estimate_bytes, write_checkpoint
from lapheads.errors import DiskFullError

STEPS, EVERY = 6, 2
SETS = ["--set", f"train.max_steps={STEPS}", "--set", f"train.ckpt_every={EVERY}", "--set", "train.threads=1"]


def _argv(out: Path, *extra: str) -> list[str]:
    return classify_argv(out, *SETS, *extra)


def _err_line(capsys) -> str:
    """The command's error line (stderr must hold exactly one ``error:`` line and no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    return lines[0]


def _no_temporaries(root: Path) -> None:
    left = [str(p) for p in root.rglob("*") if ".tmp" in p.name]
    assert not left, left


def _final(run: Path) -> bytes:
    return (run / "final" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run: checkpoints of steps 2, 4, 6 (all kept) and final/."""
    run = tmp_path_factory.mktemp("faults") / "ref"
    assert cli(_argv(run, "--set", "train.keep_checkpoints=0")) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]
    return run


def _killed_after_step4(reference: Path, dest: Path) -> Path:
    """A copy of the reference as a kill after the checkpoint of step 4 leaves it (latest still names it)."""
    shutil.copytree(reference, dest)
    shutil.rmtree(dest / "final")
    shutil.rmtree(dest / "checkpoints" / "step_00000006")
    (dest / "checkpoints" / "latest").write_text("step_00000004")
    return dest


# ----------------------------------------------------------------------------- resume from the directory
def test_resume_from_the_run_directory_alone_is_bit_identical(reference, tmp_path, capsys):
    run = _killed_after_step4(reference, tmp_path / "run")
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 0
    assert _final(run) == _final(reference)
    assert "warning" not in capsys.readouterr().err


def test_resume_with_changed_settings_is_compared_with_the_saved_config(reference, tmp_path, capsys):
    run = _killed_after_step4(reference, tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))
    assert cli(["train", "classify", "--out", str(run), "--resume", "--set", "model.depth=3"]) == 2
    line = _err_line(capsys)
    assert "model.depth (2 -> 3)" in line and str(run / "config.yaml") in line
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing touched
    # keys that cannot change a result may differ; train.threads with one warning line
    assert (
        cli(
            [
                "train",
                "classify",
                "--out",
                str(run),
                "--resume",
                "--set",
                "train.log_every=3",
                "--set",
                "train.threads=2",
            ]
        )
        == 0
    )
    warn = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning")]
    assert len(warn) == 1 and "train.threads (1 -> 2)" in warn[0]


# ----------------------------------------------------------------------------- damaged checkpoints
def _resume_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("--resume:")]
    assert len(lines) == 1, err
    return lines[0]


def test_truncated_weights_and_a_latest_naming_a_missing_step_fall_back(reference, tmp_path, capsys):
    run = _killed_after_step4(reference, tmp_path / "run")
    (run / "checkpoints" / "latest").write_text("step_00000006")  # names a step that is not there
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 0
    line = _resume_line(capsys)
    assert "step_00000006" in line and "missing" in line
    assert "skipped step_00000004" in line and f"{size // 2} bytes" in line and str(size) in line
    assert "step 2" in line
    assert _final(run) == _final(reference)
    assert {"step_00000004"} <= set(p.name for p in (run / "checkpoints").iterdir()) | set(kept)
    _no_temporaries(run)


def test_bit_flipped_state_and_another_runs_checkpoint_are_skipped(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "final")
    state = run / "checkpoints" / "step_00000006" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x10
    state.write_bytes(bytes(data))
    other = run / "checkpoints" / "step_00000004" / "state.json"  # as if copied from another run
    info = json.loads(other.read_text())
    info["run_id"] = "0123456789abcdef"
    other.write_text(json.dumps(info))
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 0
    line = _resume_line(capsys)
    assert "skipped step_00000006" in line and "state.pt" in line and "checksum" in line
    assert "skipped step_00000004" in line and "0123456789abcdef" in line
    assert "step 2" in line
    assert _final(run) == _final(reference)


def test_a_checkpoint_without_checksums_is_verified_as_far_as_it_can_be(reference, tmp_path, capsys):
    run = _killed_after_step4(reference, tmp_path / "run")
    meta = run / "checkpoints" / "step_00000004" / "state.json"
    info = json.loads(meta.read_text())
    del info["files"], info["run_id"]
    meta.write_text(json.dumps(info))
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 0
    line = _resume_line(capsys)
    assert "step_00000004" in line and "no checksums" in line
    assert _final(run) == _final(reference)


def test_no_intact_checkpoint_is_one_error_and_nothing_is_deleted(reference, tmp_path, capsys):
    run = _killed_after_step4(reference, tmp_path / "run")
    for ck in (run / "checkpoints").glob("step_*"):
        (ck / "model.safetensors").write_bytes(b"\0" * 100)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 2
    line = _err_line(capsys)
    assert "no intact checkpoint" in line and str(run / "checkpoints") in line
    assert "step_00000002" in line and "step_00000004" in line and "100 bytes" in line
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """``make(size_bytes)`` mounts a tmpfs of that size and returns its path (unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("full-disk cases mount a small tmpfs, which needs root")
    mounts = []

    def make(size: int) -> Path:
        d = tmp_path / f"disk{len(mounts)}"
        d.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}")
        mounts.append(d)
        return d

    yield make
    for d in reversed(mounts):
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _ckpt_bytes(reference: Path) -> int:
    """Disk space one checkpoint of the reference takes (tmpfs allocates whole 4 KiB pages)."""
    return sum(
        (p.stat().st_size + 4095) // 4096 * 4096 for p in (reference / "checkpoints" / "step_00000002").iterdir()
    )


def _numbers(line: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)? (?:B|KiB|MiB)", line)


def test_a_disk_too_small_for_one_checkpoint_is_refused_early(reference, small_disk, tmp_path, capsys):
    disk = small_disk(_ckpt_bytes(reference) // 2)
    run = disk / "run"
    assert cli(_argv(run)) == 2
    line = _err_line(capsys)
    assert "no space left in" in line and str(run) in line
    assert len(_numbers(line)) == 2  # what a checkpoint needs, what is free
    assert "last good checkpoint: none" in line and f"--out {run} --resume" in line
    assert not list((run / "checkpoints").glob("step_*")) if (run / "checkpoints").exists() else True
    _no_temporaries(disk)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    assert cli(["train", "classify", "--out", str(moved), "--resume"]) == 0
    assert _final(moved) == _final(reference)


def test_a_disk_full_at_the_second_checkpoint_keeps_the_first(reference, small_disk, tmp_path, capsys):
    disk = small_disk(int(_ckpt_bytes(reference) * 1.5))
    run = disk / "run"
    assert cli(_argv(run)) == 2
    line = _err_line(capsys)
    assert "no space left in" in line and str(run / "checkpoints") in line
    assert "step 4" in line and "last good checkpoint: step 2" in line and len(_numbers(line)) == 2
    _no_temporaries(disk)
    # --resume on the same full disk: the same kind of line, nothing lost
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 2
    assert "last good checkpoint: step 2" in _err_line(capsys)
    _no_temporaries(disk)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    assert cli(["train", "classify", "--out", str(moved), "--resume"]) == 0
    assert _final(moved) == _final(reference)


def test_keep_checkpoints_prunes_before_writing_when_space_is_short(reference, small_disk, capsys):
    disk = small_disk(int(_ckpt_bytes(reference) * 2.9))
    run = disk / "run"
    assert cli(_argv(run, "--set", "train.keep_checkpoints=2")) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]
    assert _final(run) == _final(reference)
    _no_temporaries(disk)
    # the same disk with every checkpoint kept (nothing may be pruned) is full at step 6
    shutil.rmtree(run)
    assert cli(_argv(run, "--set", "train.keep_checkpoints=0")) == 2
    line = _err_line(capsys)
    assert "step 6" in line and "last good checkpoint: step 4" in line
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    _no_temporaries(disk)


def test_a_full_disk_during_the_write_removes_the_partial_checkpoint(small_disk, monkeypatch):
    disk = small_disk(256 * 1024)
    ckpt = disk / "checkpoints"
    files = {"model.safetensors": {"w": torch.zeros(100_000)}, "state.pt": {"step": 1}}
    write_checkpoint(ckpt, 1, {"model.safetensors": {"w": torch.zeros(10)}, "state.pt": {"step": 1}})
    monkeypatch.setattr("lapheads.engine.checkpoint.make_room", lambda *a, **k: None)  # the estimate missed
    with pytest.raises(DiskFullError) as e:
        write_checkpoint(ckpt, 2, files, keep=2)
    assert str(ckpt) in str(e.value) and "step 2" in str(e.value)
    assert e.value.needed == estimate_bytes(files) and e.value.free is not None
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000001"]


def test_the_run_lock_on_a_full_disk_is_one_line(reference, small_disk, capsys):
    disk = small_disk(64 * 1024)
    run = disk / "run"
    run.mkdir()
    shutil.copy(reference / "config.yaml", run / "config.yaml")
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 2
    line = _err_line(capsys)
    assert "no space left in" in line and "lock" in line and str(run) in line
    assert not (run / ".lock").exists()


def test_tokenised_shards_on_a_full_disk(small_disk):
    from lapheads.data.shards import _atomic_write_bytes

    disk = small_disk(64 * 1024)
    with pytest.raises(DiskFullError) as e:
        _atomic_write_bytes(disk / "train_000000.bin", b"\1" * 200_000)
    assert str(disk) in str(e.value) and "train_000000.bin" in str(e.value) and "--resume" in str(e.value)
    assert list(disk.iterdir()) == []


def test_a_signal_during_a_checkpoint_write_leaves_no_partial_directory(tmp_path, monkeypatch):
    """A second SIGTERM (or Ctrl-C) acts at once, as a KeyboardInterrupt inside the write."""
    import lapheads.engine.checkpoint as C

    ckpt = tmp_path / "checkpoints"
    write_checkpoint(ckpt, 1, {"model.safetensors": {"w": torch.zeros(10)}, "state.pt": {"step": 1}})

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(C, "_fsync_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(ckpt, 2, {"model.safetensors": {"w": torch.zeros(10)}, "state.pt": {"step": 2}})
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000001"]


def test_a_full_disk_elsewhere_in_a_run_is_one_line_with_the_last_checkpoint(reference, tmp_path):
    """metrics.jsonl, final/, TensorBoard: any ENOSPC that reaches launch() names the file and the step."""
    from lapheads.engine.launch import disk_full_in_run

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    err = disk_full_in_run(
        OSError(errno.ENOSPC, "No space left on device", str(run / "metrics.jsonl")), "classify", run
    )
    assert isinstance(err, DiskFullError)
    msg = str(err)
    assert f"no space left in {run}:" in msg and "metrics.jsonl" in msg and "step 6" in msg
    assert f"lapheads train classify --out {run} --resume" in msg


def test_making_room_never_removes_the_last_good_checkpoint(small_disk):
    """``latest`` may name a damaged checkpoint the resume skipped: the one it resumed from is protected too."""
    from lapheads.engine.checkpoint import make_room

    ckpt = small_disk(512 * 1024) / "checkpoints"
    for step in (1, 2, 3):
        write_checkpoint(
            ckpt, step, {"model.safetensors": {"w": torch.zeros(15_000)}, "state.pt": {"step": step}}, keep=0
        )
    with pytest.raises(DiskFullError) as e:
        make_room(ckpt, 10 << 20, keep=2, what="the checkpoint of step 4", protect="step_00000001")
    assert "10.0 MiB" in str(e.value) and str(ckpt) in str(e.value)
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000001", "step_00000003"]


def test_a_full_disk_under_a_command_outside_a_run_is_one_line(small_disk, capsys):
    """A write that is not a run's own (here `lapheads analyze`'s geometry and figures) on a full
    disk: one line naming where and what is free, never a traceback."""
    from lapheads.cli import main as cli

    disk = small_disk(16 * 1024)
    rc = cli(
        [
            "analyze",
            "--checkpoint",
            "vit_tiny_patch16_224",
            "--model-args",
            "img_size=16",
            "patch_size=8",
            "depth=1",
            "num_classes=10",
            "--data",
            "digits",
            "--max-batches",
            "1",
            "--batch-size",
            "8",
            "--out",
            str(disk / "geo"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "no space left" in err[0] and str(disk) in err[0] and "free" in err[0], err[0]
