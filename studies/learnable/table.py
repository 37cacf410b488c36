"""Tables of the learnable-mixing study (used by studies/learnable/README.md).

Fixed k = 0 and k = all against learnable mixing (``laplacian_heads: learn...``), from one or more
``lapheads sweep`` directories. The sweep report compares every setting with k = 0 only and groups
runs by their Laplacian-head label, so learnable runs that differ only in the mixing's learning
rate would share one row there. This script therefore

* names a learnable setting by its label *and* its mixing learning rate (classify:
  ``optim.mix_lr_scale``, lm: ``optim.mix_lr``), so those runs stay apart;
* lists every run's final metric and plateau flag;
* compares every setting with both fixed choices, k = 0 and k = all (Welch over seeds, with the
  report's own :func:`lapheads.stats.compare`, :func:`lapheads.report.run_value`,
  :func:`~lapheads.report.run_plateau` and :func:`~lapheads.report.collect_run`);
* prints where the learned heads went: per layer, the final ``a`` and ``b`` of each head (mean over
  seeds), their Laplacian-ness ``(a - 2b + 2) / 5`` (0 standard, 1 Laplacian) and the ratio
  ``a / b``. The ratio is the scale-free part: the output projection that follows can absorb a
  common factor of ``a`` and ``b``, so ``a I + b P`` and ``c (a I + b P)`` are the same head up to
  ``W_O`` (0 = standard, -1 = Laplacian, > 0 = attention plus some of the token's own value), its
  angle ``atan(a / b)`` (0, -45 and +-90 degrees for standard, Laplacian and the identity alone;
  bounded where a / b is not, when b crosses 0), and
  how many heads lie nearer the Laplacian than the standard operator, once by the report's rule
  (Laplacian-ness > 0.5) and once by that scale-free angle (:func:`nearer_laplacian`); first
  condensed to one row per layer (mean ± std over heads and seeds), then per head.

Usage, from the repository root::

    .venv/bin/python studies/learnable/table.py /work/runs_learn/digits [/work/runs_learn/digits_lr1 ...]
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from lapheads.engine.run import RunDir
from lapheads.errors import ConfigError
from lapheads.report import collect_run, main_metric, run_plateau, run_value
from lapheads.stats import compare

# the config key of the mixing's learning rate, per recipe, and how a setting's name shows it
MIX_LR_KEY = {"classify": ("mix_lr_scale", "mix lr x{}"), "lm": ("mix_lr", "mix lr {}")}
FIXED = ("k=0", "all")


def setting(run: dict[str, Any]) -> str:
    """The run's Laplacian-head label, plus its mixing learning rate when the mixing is learned."""
    if not run["label"].startswith("learn"):
        return run["label"]
    key, fmt = MIX_LR_KEY.get(run["recipe"], (None, ""))
    optim = RunDir(run["dir"]).read_config().get("optim") or {}
    return f"{run['label']} ({fmt.format(optim[key])})" if key in optim else run["label"]


def line_angle(a: float, b: float) -> float:
    """``atan(a / b)`` in degrees, in [-90, 90]: the direction of the line through ``(b, a)``; 0 =
    standard, -45 = Laplacian, +-90 = the identity alone (bounded where ``a / b`` is not, at b = 0)."""
    return math.degrees(math.atan(a / b)) if b else 90.0


def nearer_laplacian(a: float, b: float) -> bool:
    """Whether the line through ``(b, a)`` is at a smaller angle to the Laplacian line ``a = -b``
    than to the standard line ``a = 0`` (lines, not points: ``a I + b P`` and ``c (a I + b P)`` are the
    same head up to ``W_O``, for any ``c != 0``, the sign included). Equivalent, for ``b != 0``, to
    ``a / b < -tan(22.5 deg) = -0.414`` or ``a / b > tan(67.5 deg) = 2.414`` (mostly the identity)."""
    theta = math.degrees(math.atan2(a, b))

    def to_line(deg: float) -> float:
        d = abs(theta - deg) % 180.0
        return min(d, 180.0 - d)

    return to_line(-45.0) < to_line(0.0)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _cell(c) -> str:
    if c.p is None:
        return f"{c.diff:+.4f} ({c.verdict})"
    return f"{c.diff:+.4f} [{c.ci_low:+.4f}, {c.ci_high:+.4f}], p={c.p:.2g}" + (
        f" ({'better' if c.verdict == 'observed' else 'worse'})" if c.p < 0.05 else ""
    )


def collect(sweep_dirs: list[str]) -> list[dict[str, Any]]:
    """Every finished run directory (``*/config.yaml`` with ``final/``) under the sweep directories."""
    runs = []
    for d in sweep_dirs:
        root = Path(d)
        dirs = sorted(p for p in root.iterdir() if (p / "config.yaml").is_file()) if root.is_dir() else []
        if not dirs:
            raise ConfigError(f"sweep directory {root} has no run directories (expected */config.yaml)")
        runs += [r for r in (collect_run(p) for p in dirs) if r["finished"]]
    if len({r["recipe"] for r in runs}) != 1:
        raise ConfigError(f"runs of recipes {sorted({r['recipe'] for r in runs})}: expected one recipe")
    return runs


def metric_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per setting, mean ± std of the validation metric, plateau flags, Welch vs k=0 and vs all."""
    key, name, higher = main_metric(runs[0]["recipe"])
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[setting(r)].append(r)
    order = sorted(groups, key=lambda s: (FIXED.index(s) if s in FIXED else len(FIXED), s))
    lines = [
        (
            f"| setting | runs | plateaued | {name} (mean ± std) | Δ vs k=0 [95% CI], Welch p "
            f"| Δ vs all [95% CI], Welch p |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for s in order:
        rs = groups[s]
        vals = [v for v in (run_value(r, key) for r in rs) if v is not None]
        m, sd = _mean_std(vals)
        flags = [run_plateau(r).status for r in rs]
        cells = [s, str(len(rs)), f"{flags.count('yes')}/{len(flags)}", f"{m:.4f} ± {sd:.4f}"]
        for base in FIXED:
            if base == s or base not in groups:
                cells.append("—")
                continue
            c = compare(
                base,
                [run_value(r, key) for r in groups[base]],
                s,
                [run_value(r, key) for r in rs],
                want_lower=not higher,
            )
            cells.append(_cell(c))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per setting and seed, the final validation metric and its plateau flag (the change
    of the metric over the last 20% of training, :func:`lapheads.report.run_plateau`)."""
    key, name, _ = main_metric(runs[0]["recipe"])
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[setting(r)].append(r)
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        "| setting | " + " | ".join(f"seed {s}: {name} (plateau)" for s in seeds) + " |",
        "|---" * (1 + len(seeds)) + "|",
    ]
    for s in sorted(groups, key=lambda s: (FIXED.index(s) if s in FIXED else len(FIXED), s)):
        by_seed = {r["seed"]: r for r in groups[s]}
        cells = [s]
        for seed in seeds:
            r = by_seed.get(seed)
            v = run_value(r, key) if r else None
            cells.append("—" if v is None else f"{v:.4f} ({run_plateau(r).describe()})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt_heads(per_seed: list[list[float]]) -> str:
    """Per head: the mean over seeds (and the spread over seeds when there are several)."""
    out = []
    for h in zip(*per_seed):
        m, sd = _mean_std(list(h))
        out.append(f"{m:+.2f}" + (f"±{sd:.2f}" if len(h) > 1 else ""))
    return " ".join(out)


def mixing_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per learnable setting and layer, the learned a, b, Laplacian-ness and a/b per head."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if isinstance(r["final"].get("lap_mix"), list) and r["final"]["lap_mix"]:
            groups[setting(r)].append(r)
    lines = [
        (
            "| setting | layer | a per head | b per head | Laplacian-ness per head | a / b per head "
            "| Laplacian-ness > 0.5 (heads, per seed) | nearer Laplacian by angle (heads, per seed) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(groups):
        rs = sorted(groups[s], key=lambda r: r["seed"])
        n_layers = len(rs[0]["final"]["lap_mix"])
        for i in range(n_layers):
            rows = [r["final"]["lap_mix"][i] for r in rs]
            a = [row["a"] for row in rows]
            b = [row["b"] for row in rows]
            lap = [row["laplacianness"] for row in rows]
            ratio = [[x / y if y else float("inf") for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
            count = "/".join(str(sum(v > 0.5 for v in row)) for row in lap)
            by_angle = "/".join(str(sum(nearer_laplacian(x, y) for x, y in zip(ra, rb))) for ra, rb in zip(a, b))
            lines.append(
                f"| {s} | {i} | {_fmt_heads(a)} | {_fmt_heads(b)} | {_fmt_heads(lap)} "
                f"| {_fmt_heads(ratio)} | {count} | {by_angle} |"
            )
    return "\n".join(lines)


def layer_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: :func:`mixing_table` condensed to one row per setting and layer, every number a
    mean ± std over the layer's heads and the seeds, the head counts summed over seeds."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if isinstance(r["final"].get("lap_mix"), list) and r["final"]["lap_mix"]:
            groups[setting(r)].append(r)
    lines = [
        (
            "| setting | layer | a | b | a / b | atan(a / b) (°) | Laplacian-ness | heads nearer Laplacian: "
            "by Laplacian-ness > 0.5 | by angle |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(groups):
        rs = groups[s]
        for i in range(len(rs[0]["final"]["lap_mix"])):
            rows = [r["final"]["lap_mix"][i] for r in rs]
            a = [x for row in rows for x in row["a"]]
            b = [x for row in rows for x in row["b"]]
            lap = [x for row in rows for x in row["laplacianness"]]
            ratio = [x / y for x, y in zip(a, b) if y]
            angle = [line_angle(x, y) for x, y in zip(a, b)]
            cells = [s, str(i)] + ["{:+.2f} ± {:.2f}".format(*_mean_std(v)) for v in (a, b, ratio)]
            cells += ["{:+.0f} ± {:.0f}".format(*_mean_std(angle)), "{:+.2f} ± {:.2f}".format(*_mean_std(lap))]
            cells += [
                f"{sum(v > 0.5 for v in lap)}/{len(lap)}",
                f"{sum(nearer_laplacian(x, y) for x, y in zip(a, b))}/{len(a)}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(sweep_dirs: list[str]) -> None:
    runs = collect(sweep_dirs)
    print(metric_table(runs))
    print()
    print(runs_table(runs))
    print()
    print(layer_table(runs))
    print()
    print(mixing_table(runs))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} SWEEP_DIR [SWEEP_DIR ...]")
    main(sys.argv[1:])
