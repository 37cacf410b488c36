"""The ablation study's commands (studies/ablations/README.md) run as written: both scripts, then the
table and figure script over what they wrote. Shortened to 3 steps a run and one seed through the
scripts' own ``LAPHEADS`` hook (a ``lapheads`` that appends ``--set`` overrides); every setting and
variant of the study still trains, is analysed and appears in the table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _reliability_helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "studies" / "ablations"

# the runs each script makes for one seed: (sweep folder, run folder) -> the table's setting label
DIGITS = {
    ("heads_s0", "lap0_seed0"): "k=0",
    ("heads_s0", "lap2_seed0"): "k=2",
    ("heads_s0", "lapall_seed0"): "all",
    ("heads_s0", "lapidentity:2_seed0"): "identity:2",
    ("heads_s0", "lapnegated:2_seed0"): "negated:2",
    ("heads_s0", "lapidentity:4_seed0"): "identity:4",
    ("heads_s0", "lapnegated:4_seed0"): "negated:4",
    ("variants_s0", "attention=diff__lap0_seed0"): "diff",
    ("variants_s0", "attention=xsa__lap0_seed0"): "xsa",
}
LM = {k: v for k, v in DIGITS.items() if v not in ("identity:4", "negated:4", "diff")}


@pytest.mark.slow
def test_study_scripts_and_table(tmp_path):
    short = tmp_path / "lapheads"
    short.write_text(
        f'#!/usr/bin/env bash\nexec {sys.executable} -m lapheads.cli "$@" '
        "--set train.max_steps=3 --set train.eval_every=0\n"
    )
    short.chmod(0o755)
    env = subprocess_env(LAPHEADS=str(short), OMP_NUM_THREADS="1")
    # the two scripts side by side: each runs one thread
    procs = {
        name: subprocess.Popen(
            ["bash", str(STUDY / f"run_{name}.sh"), str(tmp_path / name), "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("digits", "lm")
    }
    for name, expected in (("digits", DIGITS), ("lm", LM)):
        log, _ = procs[name].communicate(timeout=600)
        assert procs[name].returncode == 0 and "a point failed" not in log, log[-3000:]
        made = {(p.parent.name, p.name) for p in (tmp_path / name).glob("*_s0/*") if p.is_dir()}
        assert made == set(expected), made
        for sweep, run in expected:
            assert (tmp_path / name / sweep / run / "final").is_dir()
            assert any((tmp_path / name / sweep / run / "geometry").iterdir()), "--analyze wrote no geometry"

        figure = tmp_path / f"{name}.png"
        r = subprocess.run(
            [sys.executable, str(STUDY / "table.py"), str(tmp_path / name), "--figure", str(figure)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert figure.stat().st_size > 10_000 and figure.read_bytes()[:4] == b"\x89PNG"
        headline = r.stdout.split("## Contrasts")[0]
        rows = {
            m.group(1): m.group(2)
            for m in re.finditer(r"^\| ([\w=:]+) \| 1 \| [01]/1 \| ([-\d.e]+) \|", headline, re.M)
        }
        assert set(rows) == set(expected.values()), headline
        # the table's task metric of each run is the one the run wrote
        key = "top1" if name == "digits" else "val_bpb"
        for (sweep, run), label in expected.items():
            final = json.loads((tmp_path / name / sweep / run / "final" / "metrics.json").read_text())
            assert float(rows[label]) == pytest.approx(final[key], rel=1e-3), (label, rows[label], final[key])
    assert not [p for p in tmp_path.rglob("*.tmp*")], "a temporary file was left behind"
