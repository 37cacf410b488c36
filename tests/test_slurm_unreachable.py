"""``--launcher slurm`` with a controller that does not answer: one line, nothing written.

The clients (``sinfo``, ``sbatch``) are the real ones, pointed (``SLURM_CONF``) at the
``slurm.conf`` of a one-node cluster (tests/_slurm_cluster.py) whose daemons are never started.
Before anything is written the command asks ``sinfo`` and ends with its message: no
``slurm_logs/`` (submitit's job scripts and pickles), no run directory, no ``sweep_command.json``.
"""

from __future__ import annotations

import shutil

import pytest
from _reliability_helpers import snapshot
from _slurm_cluster import ClusterUnavailable, ensure_packages, write_conf

from lapheads.cli import main as cli

C = ["train", "classify", "--config", "digits", "--set", "train.max_steps=3", "--set", "train.progress=false"]
SWEEP = ["sweep", "--config", "classify/digits", "--laplacian-heads", "0", "--seeds", "0", "--no-report"]


@pytest.fixture
def unreachable(tmp_path, monkeypatch):
    try:
        ensure_packages()
    except ClusterUnavailable as e:
        pytest.skip(f"no SLURM client tools: {e}")
    if not shutil.which("sinfo"):
        pytest.skip("no sinfo")
    conf = write_conf(tmp_path / "cluster", cpus=1)  # a controller port nobody listens on
    monkeypatch.setenv("SLURM_CONF", str(conf))
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize(
    "argv",
    [
        [*C, "--out", "runs/a", "--launcher", "slurm", "--no-wait"],
        [*C, "--out", "runs/a", "--launcher", "slurm"],
        [*SWEEP, "--out", "sw", "--launcher", "slurm", "--no-wait"],
    ],
    ids=["train-no-wait", "train-wait", "sweep-no-wait"],
)
def test_an_unreachable_controller_is_one_line_and_writes_nothing(unreachable, argv, capsys):
    before = snapshot(unreachable)
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "the SLURM controller cannot be reached" in err[0] and "nothing was submitted" in err[0], err
    # sinfo's own words (a connect failure, or the munge error when no munged runs here)
    assert "slurm_load_partitions" in err[0] or "sinfo:" in err[0], err
    assert snapshot(unreachable) == before


def test_a_sweep_resumed_against_an_unreachable_controller_keeps_its_record(unreachable, tmp_path, capsys):
    # a sweep that ran before (its record and a run) is left exactly as it was
    sw = unreachable / "sw"
    assert cli([*SWEEP, "--out", str(sw), "--set", "train.max_steps=3", "--set", "train.progress=false"]) == 0
    before = snapshot(unreachable)
    capsys.readouterr()
    argv = [*SWEEP, "--out", str(sw), "--set", "train.max_steps=6", "--set", "train.progress=false"]
    assert cli([*argv, "--launcher", "slurm", "--no-wait"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be reached" in err[0], err
    assert snapshot(unreachable) == before
