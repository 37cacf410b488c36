"""benchmarks/gpu_science.py runs end to end on the CPU (--smoke, digits), so it works when a GPU is lent."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def gpu_science(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("gpu_science", None)
    import gpu_science

    return gpu_science


def test_gpu_science_smoke_on_cpu(gpu_science, tmp_path):
    out = tmp_path / "science"
    argv = ["--smoke", "--device", "cpu", "--data", "digits", "--seeds", "0,1", "--settings", "k=0,negated:1,xsa"]
    assert gpu_science.main([*argv, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["device"] == "CPU" and res["skipped"] == []
    runs = res["runs"]
    assert sorted((r["setting"], r["seed"]) for r in runs) == [
        (s, seed) for s in ("k=0", "negated:1", "xsa") for seed in (0, 1)
    ]
    for r in runs:
        assert 0.0 <= r["top1"] <= 1.0 and r["top1"] == r["curve"][-1][1] and len(r["curve"]) == 2
        assert r["k99"] > 0 and 0.0 < r["within_seq"] <= 1.0 and r["cdnv"] > 0
    # the report's Welch p against k=0 is scipy's
    md = (out / "report.md").read_text()
    top = {s: [r["top1"] for r in runs if r["setting"] == s] for s in ("k=0", "xsa")}
    row = next(line for line in md.splitlines() if line.startswith("| xsa |"))
    p = float(re.search(r"p=([0-9.e+-]+)", row).group(1))
    want = stats.ttest_ind(top["xsa"], top["k=0"], equal_var=False).pvalue
    assert p == pytest.approx(want, rel=0.05)


def test_gpu_science_budget_and_bad_settings(gpu_science, tmp_path):
    out = tmp_path / "science"
    assert (
        gpu_science.main(["--smoke", "--device", "cpu", "--data", "digits", "--budget-s", "0", "--out", str(out)]) == 0
    )
    res = json.loads((out / "results.json").read_text())
    assert res["runs"] == [] and len(res["skipped"]) == 9
    assert "Skipped (time budget" in (out / "report.md").read_text()
    with pytest.raises(SystemExit, match="unknown"):
        gpu_science.main(["--smoke", "--data", "digits", "--settings", "k=9", "--out", str(out)])


@pytest.mark.slow  # torch.compile of a tiny ViT on the CPU (about a minute on 2 cores)
def test_gpu_science_compiled_seeds_reuse_one_graph_and_match_a_fresh_compile(gpu_science, tmp_path):
    """Seed 1 of a setting runs in the module compiled for seed 0 (its fresh initialisation loaded
    into it); it must train exactly as seed 1 compiled on its own."""
    common = ["--smoke", "--device", "cpu", "--data", "digits", "--compile", "on", "--settings", "k=0"]
    assert gpu_science.main([*common, "--seeds", "0,1", "--out", str(tmp_path / "both")]) == 0
    gpu_science._COMPILED.clear()
    assert gpu_science.main([*common, "--seeds", "1", "--out", str(tmp_path / "one")]) == 0
    both = json.loads((tmp_path / "both" / "results.json").read_text())["runs"]
    one = json.loads((tmp_path / "one" / "results.json").read_text())["runs"][0]
    reused = next(r for r in both if r["seed"] == 1)
    assert reused["curve"] == one["curve"] and reused["k99"] == one["k99"] and reused["cdnv"] == one["cdnv"]
