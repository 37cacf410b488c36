"""benchmarks/gpu_check.py runs end to end on the CPU with tiny sizes (so it works when a GPU is lent)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("gpu_check", None)
    import gpu_check

    return gpu_check


def test_gpu_check_tiny_on_cpu(gpu_check, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert (
        gpu_check.main(
            ["--device", "cpu", "--compile", "off", "--repeats", "1", "--resume-steps", "10", "--json", str(out)]
        )
        == 0
    )
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["device"] == "CPU" and data["tiny"] is True
    # one table, every row in it
    assert table.count("\n|") == len(rows) + 2  # header, separator, rows
    att = [r for r in rows if r[0] == "attention"]
    assert [r[1] for r in att] == ["math, T=32", "math, T=64", "math, T=128"]
    assert all("time x" in r[3] for r in att)
    train = [r for r in rows if r[0] in ("vit-s", "nanochat-tiny")]
    assert [r[1] for r in train] == [
        f"{s}, compile off"
        for h in (6, 4)
        for s in ("k=0", f"k={h // 2}/{h}", f"k={h}/{h}", "learn", "k=0 again (A/A)")
    ]
    for r in train:
        rate = float(r[2].split()[0].replace(",", ""))
        assert rate > 0 and r[2].endswith(("images/s", "tokens/s"))  # (no MFU: no bf16 peak on the CPU)
        # every setting but k = 0 itself has its ratio to k = 0, measured in the same rounds
        if r[1].startswith("k=0,"):
            assert r[3] == ""
        else:
            assert r[3].startswith("throughput x") and r[3].endswith(" vs k=0") and float(r[3].split()[1][1:]) > 0
    (resume,) = [r for r in rows if r[0] == "exact resume"]
    assert resume[1] == "10 steps vs 5 + resume 5"
    assert resume[2].startswith("exact"), resume


def test_gpu_check_budget_marks_skipped_rows(gpu_check, capsys):
    assert gpu_check.main(["--device", "cpu", "--budget-s", "0", "--only", "attention", "resume"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped (time budget)") == 4  # three attention sizes and the resume check


def test_gpu_check_refuses_missing_cuda(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--device", "cuda"])
    assert e.value.code == 2
