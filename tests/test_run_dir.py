"""One run directory API and one atomic writer (lapheads.engine.run.RunDir, lapheads.outputs).

The state of a real run as it goes (new, partial, done), the JSON files of runs and sweeps read
through one reader (a missing file reads as ``missing=``, a corrupt one is one line), and the
writer that leaves the old content and no temporary file when the write fails.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lapheads.cli import main as cli
from lapheads.engine.run import RunDir
from lapheads.errors import CheckpointError
from lapheads.outputs import atomic_write, read_json, write_json

C = ["train", "classify", "--config", "digits", "--set", "train.max_steps=3", "--set", "train.progress=false"]


def test_atomic_write_replaces_or_keeps_and_leaves_no_temporary_file(tmp_path):
    f = tmp_path / "a.json"
    write_json(f, {"x": [1, 2]})
    assert json.loads(f.read_text()) == {"x": [1, 2]} and read_json(f) == {"x": [1, 2]}
    atomic_write(f, b"\x00\x01")
    assert f.read_bytes() == b"\x00\x01"
    # a write that cannot replace its target (a directory there) fails and changes nothing
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("k")
    with pytest.raises(OSError):
        atomic_write(tmp_path / "d", "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "d"] and (tmp_path / "d" / "keep").is_file()


def test_read_json_missing_and_corrupt(tmp_path):
    assert read_json(tmp_path / "none.json", missing={"attempts": []}) == {"attempts": []}
    with pytest.raises(CheckpointError, match="does not exist"):
        read_json(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": ')
    with pytest.raises(CheckpointError, match=r"bad\.json is not valid JSON \(the records\)"):
        read_json(bad, "the records", missing={})


def test_run_state_of_a_real_run_and_its_json_files(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.state() == "new" and run.read_json("meta.json", missing=None) is None
    assert cli([*C, "--out", str(run.path)]) == 0
    assert run.state() == "done"
    meta = run.read_json("meta.json")
    assert meta["recipe"] == "classify" and run.run_id() == meta["run_id"]
    shutil.rmtree(run.final_dir)  # a run stopped before its end
    assert run.state() == "partial"
    (run.path / "meta.json").write_text("{torn")
    assert run.run_id() is None  # unreadable: no id, as for a run from before ids were recorded
    with pytest.raises(CheckpointError, match="meta.json is not valid JSON"):
        run.read_json("meta.json")


def test_a_corrupt_slurm_record_of_a_sweep_is_one_line(tmp_path, capsys):
    sw = tmp_path / "sw"
    argv = ["sweep", "--config", "classify/digits", "--laplacian-heads", "0", "--seeds", "0", "--no-report"]
    assert cli([*argv, "--set", "train.max_steps=3", "--set", "train.progress=false", "--out", str(sw)]) == 0
    capsys.readouterr()
    assert cli(["sweep", "--status", str(sw)]) == 0
    assert "lap0_seed0" in capsys.readouterr().out
    (sw / "slurm").mkdir()
    (sw / "slurm" / "jobs.json").write_text("[not json")
    assert cli(["sweep", "--status", str(sw)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jobs.json is not valid JSON (the SLURM jobs of a sweep)" in err[0], err
