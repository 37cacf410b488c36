"""Per-grid-point Welch tests for a ``lapheads sweep`` directory (used by studies/scaling/README.md).

The sweep report's claim paragraphs pool every run of one Laplacian-head setting across the whole
grid (n = 12 vs 12 for a 2 x 2 grid with 3 seeds), so the spread between grid points (5 vs 20
epochs is 0.45 vs 0.96 accuracy) swamps any effect of k. This script makes the same comparison
*inside* each grid point (3 vs 3 seeds), with the same functions the report uses
(:func:`lapheads.report.collect_run`, :func:`~lapheads.report.run_value`,
:func:`~lapheads.report.run_plateau`, :func:`lapheads.stats.compare`), and prints a markdown table.

Usage, from the repository root::

    .venv/bin/python studies/scaling/per_point.py /tmp/study/digits
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from lapheads.errors import ConfigError
from lapheads.report import collect_run, main_metric, run_plateau, run_value
from lapheads.stats import compare

# (summary key, short name, the paper predicts a lower value with Laplacian heads)
GEOMETRY = [
    ("anova.frac_within_sequence", "within-seq frac", True),
    ("anova.frac_between_class", "between-class frac", False),
    ("spectra.k_mean", "k99", True),
    ("nc_tokens.cdnv", "CDNV", True),
]
ORDER = {"k=0": 0, "k=1": 1, "k=2": 2, "k=3": 3, "all": 9}


def _point(name: str) -> str:
    """Grid point of a sweep run directory name (``epochs=5__embed_dim=32__lap0_seed0``)."""
    head, sep, _ = name.rpartition("__lap")
    return head if sep else "(single point)"


def _cell(c) -> str:
    if c.p is None:
        return f"{c.diff:+.3g} ({c.verdict})"
    return f"{c.diff:+.3g} [{c.ci_low:+.3g}, {c.ci_high:+.3g}], p={c.p:.2g}"


def main(sweep_dir: str) -> None:
    root = Path(sweep_dir)
    dirs = sorted(p for p in root.iterdir() if (p / "config.yaml").is_file())
    if not dirs:
        raise ConfigError(f"sweep directory {root} has no run directories (expected */config.yaml)")
    runs = [collect_run(d) for d in dirs]
    recipe = runs[0]["recipe"]
    key, name, higher = main_metric(recipe)
    points: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        points[_point(r["name"])][r["label"]].append(r)

    print(
        f"| grid point | k | plateaued | {name} (mean ± std) | Δ{name} vs k=0 [95% CI], Welch p | "
        + " | ".join(f"Δ{g} vs k=0, p" for _, g, _ in GEOMETRY)
        + " |"
    )
    print("|---" * (5 + len(GEOMETRY)) + "|")
    for point in sorted(points, key=lambda p: [(len(v), v) for v in p.split("__")]):
        groups = points[point]
        base = groups.get("k=0", [])
        for label in sorted(groups, key=lambda lab: ORDER.get(lab, 5)):
            rs = groups[label]
            vals = [v for v in (run_value(r, key) for r in rs) if v is not None]
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
            plat = sum(run_plateau(r).status == "yes" for r in rs)
            cells = [point, label, f"{plat}/{len(rs)}", f"{mean:.4f} ± {std:.3f}"]
            if label == "k=0" or not base:
                cells += ["—"] * (1 + len(GEOMETRY))
            else:
                m = compare(
                    "k=0",
                    [run_value(r, key) for r in base],
                    label,
                    [run_value(r, key) for r in rs],
                    want_lower=not higher,
                )
                cells.append(f"{_cell(m)} ({m.verdict})")
                for gkey, _, lower in GEOMETRY:
                    c = compare(
                        "k=0",
                        [run_value(r, gkey) for r in base],
                        label,
                        [run_value(r, gkey) for r in rs],
                        want_lower=lower,
                    )
                    cells.append(
                        (f"{c.diff:+.3g}, p={c.p:.2g}" + (f" ({c.verdict})" if c.p < 0.05 else ""))
                        if c.p is not None
                        else c.verdict
                    )
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: per_point.py SWEEP_DIR")
    main(sys.argv[1])
