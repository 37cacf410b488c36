"""What ``lapheads quickstart --tiny`` must leave behind: every file, one row per k, finite
numbers, a report whose links and images all resolve. Checked on the run of the installed wheel
(tests/test_packaging.py), outside the repository, which is the newcomer's path."""

from __future__ import annotations

import math
import re
from pathlib import Path


def check_quickstart_tiny(out: Path, printed: str) -> None:
    """Assert the output directory ``out`` of ``lapheads quickstart --tiny`` and its printed text
    (stdout and stderr, captured by a pipe: no library's progress bar or warning in it)."""
    assert str(out / "report" / "report.html") in printed
    assert "it/s" not in printed and "Warning" not in printed, printed[-3000:]
    runs = sorted(p.parent.parent.name + "/" + p.parent.name for p in out.glob("*/*/config.yaml"))
    assert runs == [
        "lm/lap0_seed0",
        "lm/lap0_seed1",
        "lm/lapall_seed0",
        "lm/lapall_seed1",
        "vision/lap0_seed0",
        "vision/lap0_seed1",
        "vision/lapall_seed0",
        "vision/lapall_seed1",
    ]
    for run in out.glob("*/lap*_seed*"):
        for f in (
            "config.yaml",
            "meta.json",
            "metrics.jsonl",
            "final/model.safetensors",
            "final/model.json",
            "final/metrics.json",
            "geometry/geometry.json",
        ):
            assert (run / f).is_file(), (run, f)
    md = (out / "report" / "report.md").read_text()
    for section in ("## classify", "## lm"):
        body = md.split(section, 1)[1].split("\n## ", 1)[0]
        rows = [l for l in body.splitlines() if re.match(r"\| (k=0|k=2|all) \|", l)]
        assert [r.split("|")[1].strip() for r in rows] == ["k=0", "all"], body
        for row in rows:
            if section == "## classify":  # evaluated along the way: every run has a plateau flag
                assert "unknown" not in row.split("|")[3], row
            for cell in [c.strip() for c in row.strip("|").split("|")][3:]:  # after setting, runs, plateaued
                value = float(cell.split(" ± ")[0])
                assert math.isfinite(value), row
    for ref in re.findall(r"\]\(([^)]+)\)", md):
        assert (out / "report" / ref).is_file(), ref
    html = (out / "report" / "report.html").read_text()
    srcs = re.findall(r"""<img [^>]*src=["']([^"']+)["']""", html)
    assert len(srcs) == len(re.findall(r"\]\(([^)]+)\)", md)) > 0
    for src in srcs:
        assert src.startswith("data:image/png;base64,"), src[:60]
    # honest about what ran (2 seeds, a few steps): said from the runs, no verdict, no raw Markdown
    assert md.count("What was run: k=0: 2 run(s), seed(s) 0, 1; all: 2 run(s), seed(s) 0, 1.") == 2
    assert "3 seeds each" not in md and ": observed" not in md and ": opposite" not in md
    assert "<strong>What this can and cannot say.</strong>" in html and "**" not in html
    headings = re.findall(r"^#+ .*$", md, re.M)
    assert len(headings) >= 3, headings  # the report's structure: a title and its sections
