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
        "--set", "train.ckpt_every=1", "--set", "train.log_every=1", "--set", "train.eval_every=1"]


def _sweep_argv(out: Path, steps: int) -> list[str]:  # (the report's --analyze: tests below)
    return ["sweep", "--config", DIGITS, "--laplacian-heads", "0,all", "--seeds", "0", "--out", str(out),
            "--set", f"train.max_steps={steps}", *TINY]


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


@pytest.fixture(scope="module")
def analyzed_report(tiny_runs, tmp_path_factory) -> tuple[list[Path], Path]:
    """``report --analyze`` over copies of the six runs, made once: the tests below only read it."""
    root = tmp_path_factory.mktemp("analyzed_report")
    dirs = _copies(tiny_runs, root)
    out = root / "rep"
    assert cli(["report", *map(str, dirs), "--out", str(out), "--analyze"]) == 0
    return dirs, out


def test_report_groups_runs_and_references_existing_files(analyzed_report):
    dirs, out = analyzed_report
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
    # validation curves (three eval points per run) and their plateau flags
    assert (out / "figures" / "classify_val_curves.png").is_file()
    runs_table = md[md.index("## Runs"):]
    for d in dirs:
        flag = summary["classify"][{"0": "k=0", "1": "k=1", "all": "all"}[d.name[1:-3]]]["plateau"][d.name]
        assert flag["eval_points"] == 3 and flag["status"] in ("yes", "no")
        assert re.search(rf"\| {d.name} \| classify \| .* \| 3 \| {flag['status']} \(", runs_table), runs_table


def test_report_verdicts_carry_welch_statistics(analyzed_report):
    """Every claim paragraph and summary.json give the difference, its 95% CI, Welch's t and p and
    the seeds; a verdict is observed/opposite only at p < 0.05; NC1 is among the claims."""
    from scipy import stats as st
    from lapheads.report import collect_run, run_value
    from lapheads.stats import seeds_needed

    dirs, out = analyzed_report
    md = (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    paras = [l for l in md.splitlines() if l.startswith("**classify: ")]
    assert any("neural collapse of image/sequence means" in p for p in paras)
    assert any("neural collapse at the classifier input" in p for p in paras)
    for p in paras:
        assert "95% CI" in p and "Welch t = " in p and "p = " in p and "n = 2 vs 2 seeds" in p, p
    runs = [collect_run(d) for d in dirs]
    base = [r for r in runs if r["label"] == "k=0"]
    for label in ("k=1", "all"):
        comps = summary["classify"][label]["comparisons"]
        assert {"top1", "nc_sequence_means.nc1", "classifier_input.nc1", "anova.frac_within_sequence"} <= set(comps)
        other = [r for r in runs if r["label"] == label]
        for key, c in comps.items():
            a = [run_value(r, key) for r in base]
            b = [run_value(r, key) for r in other]
            ref = st.ttest_ind(b, a, equal_var=False)
            assert c["diff"] == pytest.approx(sum(b) / 2 - sum(a) / 2, abs=1e-12)
            assert c["t"] == pytest.approx(ref.statistic) and c["p"] == pytest.approx(ref.pvalue)
            ci = ref.confidence_interval(0.95)
            assert (c["ci_low"], c["ci_high"]) == pytest.approx((ci.low, ci.high))
            assert c["n_baseline"] == c["n_other"] == 2
            if c["p"] >= 0.05:
                assert c["verdict"] == "not resolved" and c["seeds_needed"] == seeds_needed(c["effect_size"])
            else:
                good = c["diff"] < 0 if c["want_lower"] else c["diff"] > 0
                assert c["verdict"] == ("observed" if good else "opposite")
            if key == "top1":
                assert f"{label} vs k=0: difference" in md


def test_report_single_seed_is_not_tested_and_integers_print_in_full(tmp_path, tiny_runs):
    dirs = _copies([tiny_runs[0], tiny_runs[4]], tmp_path)  # k=0 and all, one seed each
    m = json.loads((dirs[0] / "final" / "metrics.json").read_text())
    m["n"] = 10000
    (dirs[0] / "final" / "metrics.json").write_text(json.dumps(m))
    with open(dirs[1] / "metrics.jsonl", "a") as f:  # as if train.until_plateau had stopped it at step 3
        f.write(json.dumps({"step": 3, "event": "until_plateau_stop", "metric": "top1"}) + "\n")
    out = tmp_path / "rep"
    assert cli(["report", *map(str, dirs), "--out", str(out), "--plateau-tol", "10"]) == 0
    md = (out / "report.md").read_text()
    assert "n=10000" in md and "e+04" not in md
    assert "single run, no test" in md and ": observed" not in md and ": opposite" not in md
    c = json.loads((out / "summary.json").read_text())["classify"]["all"]["comparisons"]["top1"]
    assert c["verdict"] == "single run" and c["p"] is None
    assert "| k0_s0 | classify | k=0 | 0 | 3 | yes (" in md  # every run plateaus at a 1000% tolerance
    assert "| kall_s0 | classify | all | 0 | 3 | yes (stopped by train.until_plateau at step 3) |" in md
    assert "Convergence:" not in md
    assert cli(["report", *map(str, dirs), "--out", str(tmp_path / "bad"), "--plateau-window", "0"]) == 2


def test_number_formatting():
    from lapheads.report import _fmt, _num
    assert _num(10000) == "10000" and _num(10000.0) == "10000" and _num(123456.7) == "123457"
    assert _num(0.123456) == "0.1235" and _num(True) == "True"
    assert _fmt(12000.0, 1500.0, 3) == "12000 ± 1500"


def test_pca_images_come_from_several_classes_and_in_colour(tmp_path):
    from PIL import Image
    from lapheads.data.images import load_images, spread_over_classes

    assert spread_over_classes([0, 0, 0, 1, 1, 2], 4) == [0, 3, 5, 1]
    assert spread_over_classes(["b", "a", "b"], 5) == [1, 0, 2]
    colours = {"cat": (255, 0, 0), "dog": (0, 255, 0), "eel": (0, 0, 255)}
    for name, rgb in colours.items():  # a class-sorted folder: the first 3 files are all "cat"
        (tmp_path / name).mkdir()
        for i in range(4):
            Image.new("RGB", (8, 8), rgb).save(tmp_path / name / f"{i}.png")
    imgs = load_images(str(tmp_path), max_images=3)
    assert sorted(im.getpixel((0, 0)) for im in imgs) == sorted(colours.values())
    digits = load_images("digits", max_images=10)  # a data spec: one image of each of the 10 digits
    from lapheads.data.images import build_image_dataset
    ds = build_image_dataset("digits", "val")
    idx = spread_over_classes(list(ds.targets), 10)
    assert sorted(int(ds.targets[i]) for i in idx) == list(range(10)) and len(digits) == 10


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (make test installs it)")
def test_html_report_renders_with_every_image_loaded(tmp_path, analyzed_report):
    out = analyzed_report[1]
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


def test_report_reads_the_metric_keys_each_recipe_logs():
    """The report's dino metrics are the keys DINO's evaluation writes (knn_k{k}_top1)."""
    import torch
    from lapheads.recipes.dino import KnnConfig
    from lapheads.vision.probes import knn_classify
    from lapheads.report import METRICS

    f = torch.randn(30, 4)
    y = torch.arange(30) % 3
    logged = knn_classify(f, y, f[:6], y[:6], ks=KnnConfig().ks)
    assert {k for k, _, _ in METRICS["dino"]} <= set(logged)
