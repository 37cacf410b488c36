"""``--overwrite`` deletes a run and nothing else (engine.run.RunDir.check_overwrite).

Every case is a real ``lapheads train classify --config digits`` (3 steps) or ``lapheads sweep``
in a scratch directory, with a file of the user's that must survive: a refused ``--overwrite`` is
one line (exit 2) and changes nothing (the directory is byte-for-byte the same); an accepted one
replaces the run's own files and only those.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _reliability_helpers import snapshot

from lapheads.cli import main as cli
from lapheads.engine.run import RUN_ENTRIES, RunDir
from lapheads.errors import CheckpointError

C = ["train", "classify", "--config", "digits", "--set", "train.max_steps=3", "--set", "train.progress=false"]


def _train(out: Path | str, *extra: str) -> list[str]:
    return [*C, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished 3-step run, copied by the cases that need a run directory."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert cli(_train(run)) == 0
    return run


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def _refused(capsys, argv: list[str], keep: Path, *needles: str) -> str:
    """Run ``argv``; it must exit 2 with one stderr line holding ``needles`` and leave ``keep`` unchanged."""
    before = snapshot(keep)
    capsys.readouterr()
    rc = cli(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (rc, err)
    for n in needles:
        assert n in err[0], (n, err[0])
    assert snapshot(keep) == before, f"{keep} changed"
    return err[0]


def _run_id(run: Path) -> str:
    return json.loads((run / "meta.json").read_text())["run_id"]


def test_the_current_directory_is_refused(tmp_path, monkeypatch, capsys, finished):
    # a directory of the user's files: scripts, another run
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.sh").write_text("#!/bin/sh\n")
    _copy(finished, work / "other_run")
    monkeypatch.chdir(work)
    _refused(capsys, _train(".", "--overwrite"), work, "--overwrite", "the current directory", "choose another --out")
    # even when the current directory is itself a run: the user is standing in it
    run = _copy(finished, tmp_path / "run")
    monkeypatch.chdir(run)
    _refused(capsys, _train(".", "--overwrite"), run, "the current directory")
    _refused(capsys, _train(str(run), "--overwrite"), run, "the current directory")


def test_an_ancestor_of_the_working_directory_is_refused(tmp_path, monkeypatch, capsys, finished):
    run = _copy(finished, tmp_path / "run")
    monkeypatch.chdir(run / "final")
    line = _refused(capsys, _train("..", "--overwrite"), run, "an ancestor of the current directory")
    assert str((run / "final").resolve()) in line
    monkeypatch.chdir(run / "checkpoints")
    _refused(capsys, _train(str(run), "--overwrite"), run, "an ancestor of the current directory")


def test_a_directory_holding_the_config_being_read_is_refused(tmp_path, monkeypatch, capsys, finished):
    monkeypatch.chdir(tmp_path)
    # the case: DIR holds the config and the user's notes, no run
    d = tmp_path / "d"
    d.mkdir()
    from lapheads.recipes.shipped import resolve_config

    shutil.copy(resolve_config("classify", "digits"), d / "my.yaml")
    (d / "notes.txt").write_text("mine")
    argv = ["train", "classify", "--config", str(d / "my.yaml"), "--out", str(d), "--overwrite"]
    _refused(capsys, [*argv, "--set", "train.max_steps=3"], d, "my.yaml", "which this command reads")
    # a run's own config.yaml read as --config of the run that would replace it
    run = _copy(finished, tmp_path / "run")
    argv = ["train", "classify", "--config", str(run / "config.yaml"), "--out", str(run), "--overwrite"]
    _refused(capsys, argv, run, "config.yaml", "which this command reads")


def test_a_run_with_a_file_lapheads_did_not_write_is_refused_naming_it(tmp_path, monkeypatch, capsys, finished):
    monkeypatch.chdir(tmp_path)
    run = _copy(finished, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    (run / "zz_plot.png").write_bytes(b"\x89PNG")
    _refused(capsys, _train(run, "--overwrite"), run, "notes.txt and 1 more", "not one of the run's own files")
    # the Python API refuses the same way (the engine, without the command line)
    with pytest.raises(CheckpointError, match="notes.txt"):
        RunDir(run).check_overwrite()
    # a run inside the run (a retrofit's baseline) is checked too
    (run / "notes.txt").unlink()
    (run / "zz_plot.png").unlink()
    _copy(finished, run / "baseline")
    (run / "baseline" / "draft.md").write_text("mine")
    _refused(capsys, _train(run, "--overwrite"), run, "baseline/draft.md")
    (run / "baseline" / "draft.md").unlink()
    (run / "retrofit.json").write_text("{}")
    assert cli(_train(run, "--overwrite")) == 0
    assert not (run / "baseline").exists() and not (run / "retrofit.json").exists()


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "papers"
    d.mkdir()
    (d / "draft.tex").write_text("\\section{}")
    _refused(capsys, _train(d, "--overwrite"), d, "not a run directory", "deletes only a run")
    _refused(capsys, _train(d), d, "not empty and holds no run")


def test_a_sweep_directory_is_not_replaced_by_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sw = tmp_path / "sw"
    sweep = ["sweep", "--config", "classify/digits", "--laplacian-heads", "0", "--seeds", "0", "--no-report"]
    sweep += ["--set", "train.max_steps=3", "--set", "train.progress=false", "--out", str(sw)]
    assert cli(sweep) == 0
    assert (sw / "sweep_command.json").is_file() and (sw / "lap0_seed0" / "final" / "model.json").is_file()
    _refused(capsys, _train(sw, "--overwrite"), sw, "a sweep directory")

    # the sweep's own --overwrite deletes its grid runs only: a file beside them survives, one inside
    # a run stops it before anything is deleted
    (sw / "notes.txt").write_text("mine")
    (sw / "lap0_seed0" / "my_eval.json").write_text("{}")
    _refused(capsys, [*sweep, "--overwrite"], sw, "lap0_seed0", "my_eval.json", "--overwrite")
    (sw / "lap0_seed0" / "my_eval.json").unlink()
    old = _run_id(sw / "lap0_seed0")
    assert cli([*sweep, "--overwrite"]) == 0
    assert _run_id(sw / "lap0_seed0") != old and (sw / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_a_run_and_only_its_files(tmp_path, monkeypatch, capsys, finished):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("beside the run")
    run = _copy(finished, tmp_path / "run")
    # what the other commands add to a run is the run's too
    (run / "geometry").mkdir()
    (run / "geometry" / "geometry.json").write_text("{}")
    (run / "slurm.json").write_text('{"attempts": []}')
    (run / ".metrics.jsonl.tmp-4242").write_text("torn")  # a write killed half-way
    assert {p.name for p in run.iterdir()} - RUN_ENTRIES == {".metrics.jsonl.tmp-4242"}
    old = _run_id(run)
    assert cli(_train(run, "--overwrite")) == 0
    assert _run_id(run) != old
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in finished.iterdir())
    assert (tmp_path / "keep.txt").read_text() == "beside the run"
    # a missing or empty --out needs no --overwrite, but it does no harm
    assert cli(_train(tmp_path / "fresh", "--overwrite")) == 0
    (tmp_path / "empty").mkdir()
    assert cli(_train(tmp_path / "empty", "--overwrite")) == 0
    assert (tmp_path / "empty" / "final" / "model.json").is_file()


def test_quickstart_overwrite_deletes_its_runs_only(tmp_path, monkeypatch, capsys):
    # a quickstart folder: its vision runs beside the user's file; one run holds a foreign file
    monkeypatch.chdir(tmp_path)
    q = tmp_path / "q"
    assert cli(_train(q / "vision" / "lap0_seed0")) == 0
    (q / "notes.txt").write_text("mine")
    (q / "vision" / "lap0_seed0" / "draft.md").write_text("mine too")
    argv = ["quickstart", "--tiny", "--no-lm", "--jobs", "1", "--out", str(q), "--overwrite"]
    _refused(capsys, argv, q, "lap0_seed0", "draft.md", "not one of the run's own files")
    # without it, the run (made with other settings) is retrained as the quickstart's; the notes stay
    (q / "vision" / "lap0_seed0" / "draft.md").unlink()
    old = _run_id(q / "vision" / "lap0_seed0")
    assert cli(argv) == 0
    assert "lap0_seed0: deleted to start afresh" in capsys.readouterr().out
    assert _run_id(q / "vision" / "lap0_seed0") != old and (q / "notes.txt").read_text() == "mine"
    assert (q / "report" / "report.md").is_file()
