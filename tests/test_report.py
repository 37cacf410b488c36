"""Sweep (interrupted and restarted), report files, and the HTML report rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lapheads.cli import main as cli

# one xdist worker runs this module, so the module-scoped runs are trained once
pytestmark = pytest.mark.xdist_group("report")

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "recipes" / "classify" / "digits.yaml")
TINY = ["--set", "model.embed_dim=32", "--set", "model.depth=2", "--set", "model.num_heads=2",
        "--set", "train.progress=false", "--set", "data.batch_size=32", "--set", "data.max_eval_items=64",
        "--set", "train.ckpt_every=1", "--set", "train.log_every=1"]


def _sweep_argv(out: Path, steps: int) -> list[str]:
    return ["sweep", "--config", DIGITS, "--laplacian-heads", "0,all", "--seeds", "0", "--out", str(out),
            "--set", f"train.max_steps={steps}", *TINY, "--analyze"]


def _summary_numbers(path: Path) -> dict:
    s = json.loads(path.read_text())
    return {rec: {lb: {k: v for k, v in g.items() if k != "runs"} for lb, g in groups.items()}
            for rec, groups in s.items()}


@pytest.mark.slow
def test_interrupted_sweep_skips_finished_runs_and_aggregates_the_same(tmp_path):
    steps = 12
    ref = tmp_path / "ref"
    assert cli(_sweep_argv(ref, steps)) == 0
    ref_summary = _summary_numbers(ref / "report" / "summary.json")

    out = tmp_path / "interrupted"
    import torch
    # the same intra-op thread count as this process: float reductions then match bit for bit
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), LAPHEADS_TEST_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen([sys.executable, "-m", "lapheads.cli", *_sweep_argv(out, steps)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    second = out / "lapall_seed0"
    deadline = time.time() + 300
    # kill once the first run is finished and the second has written a checkpoint but not finished
    while time.time() < deadline:
        if (second / "checkpoints" / "latest").is_file() and not (second / "final").exists():
            break
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first_final = out / "lap0_seed0" / "final" / "model.safetensors"
    assert first_final.is_file() and not (second / "final" / "model.json").exists()
    mtime = first_final.stat().st_mtime_ns
    assert cli(_sweep_argv(out, steps)) == 0
    assert first_final.stat().st_mtime_ns == mtime, "a finished run was trained again"
    starts = json.loads((second / "meta.json").read_text())["starts"]
    assert [s["resume"] for s in starts] == [False, True]
    assert _summary_numbers(out / "report" / "summary.json") == ref_summary
    md = (out / "report" / "report.md").read_text()
    assert "| k=0 | 1 |" in md and "| all | 1 |" in md


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> list[Path]:
    """Six tiny finished runs (k = 0 / 1 / all x seeds 0, 1), trained once for this module.

    Tests that write into a run (analysis results) work on copies, so every test sees the runs
    exactly as training left them."""
    root = tmp_path_factory.mktemp("tiny_runs")
    dirs = []
    for k in ("0", "1", "all"):
        for seed in (0, 1):
            d = root / f"k{k}_s{seed}"
            assert cli(["train", "classify", "--config", DIGITS, "--out", str(d), "--set", f"model.laplacian_heads={k}",
                        "--set", f"train.seed={seed}", "--set", "train.max_steps=3", *TINY]) == 0
            dirs.append(d)
    return dirs


def _copies(dirs: list[Path], dest: Path) -> list[Path]:
    out = []
    for d in dirs:
        shutil.copytree(d, dest / d.name)
        out.append(dest / d.name)
    return out


def test_report_groups_runs_and_references_existing_files(tmp_path, tiny_runs):
    dirs = _copies(tiny_runs, tmp_path)
    out = tmp_path / "rep"
    assert cli(["report", *map(str, dirs), "--out", str(out), "--analyze"]) == 0
    md = (out / "report.md").read_text()
    rows = [l for l in md.splitlines() if re.match(r"\| (k=0|k=1|all) \| 2 \|", l)]
    assert len(rows) == 3, md
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for c in cells[2:]:
            assert c != "-" and "nan" not in c.lower(), row
    for ref in re.findall(r"\]\(([^)]+)\)", md):
        assert (out / ref).is_file(), ref
    html = (out / "report.html").read_text()
    assert "src='figures/" not in html and html.count("data:image/png;base64,") >= 4
    assert "The paper's claims" in md and "within-sequence" in md
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["classify"]) == {"k=0", "k=1", "all"}


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (make test installs it)")
def test_html_report_renders_with_every_image_loaded(tmp_path, tiny_runs):
    dirs = _copies(tiny_runs[::2], tmp_path)
    out = tmp_path / "rep"
    assert cli(["report", *map(str, dirs), "--out", str(out), "--analyze"]) == 0
    r = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=10000", "--dump-dom",
                        (out / "report.html").resolve().as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'data-images-total="(\d+)" data-images-loaded="(\d+)"', r.stdout)
    assert m, r.stdout[:500] + r.stderr[-500:]
    total, loaded = int(m.group(1)), int(m.group(2))
    assert total >= 4 and loaded == total


def test_analyze_cli_on_runs_of_this_project(tmp_path, tiny_runs):
    dirs = _copies([tiny_runs[0], tiny_runs[4]], tmp_path)  # k=0 and k=all, seed 0
    assert not any((d / "geometry").exists() for d in dirs)
    out = tmp_path / "geo"
    assert cli(["analyze", "--run", str(dirs[0]), "--run", str(dirs[1]), "--max-items", "64", "--out", str(out)]) == 0
    res = json.loads((out / "geometry.json").read_text())
    assert set(res["runs"]) == {"k0_s0", "kall_s0"}
    for r in res["runs"].values():
        a = r["layers"]["blocks.1"]["anova"]
        parts = a["within_sequence"] + a["between_sequence_within_class"] + a["between_class"]
        assert abs(parts - a["total"]) <= 1e-9 * a["total"]
    assert len(list(out.glob("*.png"))) >= 4
    for d in dirs:  # each run also keeps its own geometry.json for the report
        assert (d / "geometry" / "geometry.json").is_file()
    assert cli(["analyze", "--run", str(tmp_path / "missing"), "--out", str(out)]) == 2
