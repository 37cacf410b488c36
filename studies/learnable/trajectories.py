"""Where the learnable heads go during training (a figure for studies/learnable/README.md).

Every evaluation logs the mixing ``lap_mix`` to a run's ``metrics.jsonl`` (per layer: ``a``, ``b``
and the Laplacian-ness per head). The report draws the final values as heatmaps; this script draws
their path: one row per learnable setting (named as in ``table.py``: label and mixing learning
rate), one column per layer, one line per head (the mean over seeds, the band its range over seeds),
against the optimizer step. The measure is the Laplacian-ness ``(a - 2b + 2) / 5`` (0 standard,
1 Laplacian), the scale-free ratio ``a / b`` (0 standard, -1 Laplacian) or its angle
``atan(a / b)`` in degrees (0 standard, -45 Laplacian, bounded where ``b`` crosses 0); dashed lines mark the
two fixed operators, a dotted line the value equidistant from them.

Usage, from the repository root::

    .venv/bin/python studies/learnable/trajectories.py OUT.png laplacianness SWEEP_DIR [SWEEP_DIR ...]
    .venv/bin/python studies/learnable/trajectories.py OUT.png angle SWEEP_DIR [SWEEP_DIR ...]
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from lapheads.engine.run import RunDir
from lapheads.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import collect, line_angle, setting

# (axis label, the two fixed operators, the value equidistant from them). For a / b the middle is
# by angle: the lines a = 0 (standard) and a = -b (Laplacian) are 45 degrees apart in the (b, a)
# plane, and a / b = -tan(22.5 deg) = -0.414 lies 22.5 degrees from each.
# The angle atan(a / b) in degrees is the same scale-free quantity, bounded: 0 standard, -45 Laplacian,
# +-90 the identity alone (b = 0, where a / b jumps to +-infinity when b changes sign).
MEASURES = {
    "laplacianness": ("Laplacian-ness (0 standard, 1 Laplacian)", (0.0, 1.0), 0.5),
    "ratio": ("a / b (0 standard, -1 Laplacian)", (0.0, -1.0), -math.tan(math.pi / 8)),
    "angle": ("atan(a / b), degrees\n(0 standard, -45 Laplacian)", (0.0, -45.0), -22.5),
}


def _series(run_dir: str, measure: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of shape (evaluations, layers, heads) from a run's metrics.jsonl."""
    steps, values = [], []
    for rec in RunDir(run_dir).metrics():
        mix = rec.get("lap_mix")
        if not isinstance(mix, list) or not mix:
            continue
        if measure == "laplacianness":
            v = [row["laplacianness"] for row in mix]
        elif measure == "angle":
            v = [[line_angle(a, b) for a, b in zip(row["a"], row["b"])] for row in mix]
        else:
            v = [[a / b if b else np.nan for a, b in zip(row["a"], row["b"])] for row in mix]
        steps.append(rec["step"])
        values.append(v)
    return np.asarray(steps), np.asarray(values, dtype=float)


def main(out: str, measure: str, sweep_dirs: list[str]) -> None:
    if measure not in MEASURES:
        raise ConfigError(f"measure {measure!r}: expected one of {sorted(MEASURES)}")
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in collect(sweep_dirs):
        if r["label"].startswith("learn"):
            groups[setting(r)].append(r)
    if not groups:
        raise ConfigError(f"no run with learnable mixing under {', '.join(sweep_dirs)}")
    names = sorted(groups)
    series = {s: [_series(r["dir"], measure) for r in groups[s]] for s in names}
    n_layers = series[names[0]][0][1].shape[1]
    ylabel, refs, middle = MEASURES[measure]
    fig, axes = plt.subplots(
        len(names), n_layers, figsize=(2.6 * n_layers, 2.1 * len(names)), sharex=True, sharey=True, squeeze=False
    )
    for i, s in enumerate(names):
        n = min(len(st) for st, _ in series[s])  # the evaluations every seed has
        steps = series[s][0][0][:n]
        vals = np.stack([v[:n] for _, v in series[s]])  # (seeds, evaluations, layers, heads)
        for j in range(n_layers):
            ax = axes[i][j]
            for ref in refs:
                ax.axhline(ref, color="0.7", lw=0.8, ls="--")
            ax.axhline(middle, color="0.7", lw=0.8, ls=":")
            for h in range(vals.shape[3]):
                (line,) = ax.plot(steps, vals[:, :, j, h].mean(0), lw=1.2, label=f"head {h}")
                ax.fill_between(
                    steps, vals[:, :, j, h].min(0), vals[:, :, j, h].max(0), alpha=0.15, color=line.get_color()
                )
            if i == 0:
                ax.set_title(f"layer {j}", fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{s}\n{ylabel}" if len(names) > 1 else ylabel, fontsize=7)
            if i == len(names) - 1:
                ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(f"usage: {sys.argv[0]} OUT.png laplacianness|ratio|angle SWEEP_DIR [SWEEP_DIR ...]")
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
