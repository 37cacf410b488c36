"""Validation curves per grid point of a ``lapheads sweep`` (used by studies/scaling/README.md).

The sweep report draws one validation curve per Laplacian-head setting over *all* grid points,
cut to the steps every run has (so a 5-epoch run hides the 20-epoch ones). This figure draws one
panel per grid point, one line per k (mean ± std over seeds), so convergence can be judged where
the comparison is made. It reads the runs through :func:`lapheads.report.collect_run`.

Usage, from the repository root::

    .venv/bin/python studies/scaling/curves.py /tmp/study/digits studies/scaling/figures/digits_val_curves.png
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)
import numpy as np  # noqa: E402
from per_point import ORDER, _point  # noqa: E402  (the same grid-point rule as the tables)

from lapheads.errors import ConfigError  # noqa: E402
from lapheads.report import collect_run, main_metric  # noqa: E402


def main(sweep_dir: str, out: str) -> None:
    root = Path(sweep_dir)
    dirs = sorted(p for p in root.iterdir() if (p / "config.yaml").is_file())
    if not dirs:
        raise ConfigError(f"sweep directory {root} has no run directories (expected */config.yaml)")
    runs = [collect_run(d) for d in dirs]
    key, name, _ = main_metric(runs[0]["recipe"])
    points: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        points[_point(r["name"])][r["label"]].append(r)
    order = sorted(points, key=lambda p: [(len(v), v) for v in p.split("__")])
    fig, axes = plt.subplots(1, len(order), figsize=(3.2 * len(order), 2.8), squeeze=False)
    for ax, point in zip(axes[0], order):
        for label in sorted(points[point], key=lambda lab: ORDER.get(lab, 5)):
            curves = [{r_["step"]: r_[key] for r_ in r["val"] if key in r_} for r in points[point][label]]
            steps = sorted(set.intersection(*(set(c) for c in curves)))  # steps every seed evaluated
            vals = np.array([[c[s] for s in steps] for c in curves])
            m, s = vals.mean(0), vals.std(0, ddof=1) if len(vals) > 1 else np.zeros(len(steps))
            ax.plot(steps, m, marker=".", label=f"{label} (n={len(vals)})")
            ax.fill_between(steps, m - s, m + s, alpha=0.2)
        ax.set_title(point.replace("__", ", "), fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel(name, fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: curves.py SWEEP_DIR OUT.png")
    main(sys.argv[1], sys.argv[2])
