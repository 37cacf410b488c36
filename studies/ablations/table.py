"""Tables and the figure of the ablation study (used by studies/ablations/README.md).

From the run directories under one study folder (``lapheads sweep`` outputs: ``heads_s*``,
``half_s*``, ``variants_s*``), with the report's own :func:`lapheads.report.collect_run` (which
labels a run by its head setting, or ``diff`` / ``xsa`` for the other attentions),
:func:`~lapheads.report.run_value`, :func:`~lapheads.report.run_plateau` and
:func:`lapheads.stats.compare` (Welch over seeds):

* the headline table: per setting the runs, plateaued runs, the task metric, k99, the
  within-sequence share of the token variance and the token CDNV of the last block (mean ± std),
  each with its difference from ``k=0`` and the Welch p;
* the contrasts, on the task metric: the Laplacian settings against ``k=0``, and what says which
  part of ``V - P V`` matters, each fixed ablation against the Laplacian setting with the same
  heads (``identity:K`` and ``negated:K`` against ``k=K``) and against ``k=0``; each by Welch's
  test and, since a seed fixes the initialisation stream and the data order of every setting, by
  the paired t-test over seeds too;
* a figure: one panel per quantity, every seed a dot and the mean a bar, per setting.

Usage, from the repository root::

    .venv/bin/python studies/ablations/table.py /work/runs_abl/digits [--figure studies/ablations/figures/digits.png]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from lapheads.errors import ConfigError
from lapheads.heads import LaplacianHeads
from lapheads.report import collect_run, main_metric, run_plateau, run_value
from lapheads.stats import compare

#: (summary key of lapheads.report.GEOMETRY, column name, the paper's direction: lower is "smoother")
GEOMETRY = [
    ("spectra.k_mean", "k99", True),
    ("anova.frac_within_sequence", "within-seq frac", True),
    ("nc_tokens.cdnv", "CDNV (tokens)", True),
]


def collect(study_dir: str) -> list[dict[str, Any]]:
    """Every finished run under ``study_dir/*/`` (one level of sweep folders)."""
    root = Path(study_dir)
    dirs = sorted(p for p in root.glob("*/*") if (p / "config.yaml").is_file())
    runs = [r for r in (collect_run(p) for p in dirs) if r["finished"]]
    if not runs:
        raise ConfigError(f"{root} has no finished run directories (expected */*/config.yaml with final/)")
    if len({r["recipe"] for r in runs}) != 1:
        raise ConfigError(f"runs of recipes {sorted({r['recipe'] for r in runs})}: expected one recipe")
    return runs


def order(labels: list[str]) -> list[str]:
    """k=0 first, the Laplacian settings, the ablations, then the other attentions."""
    return sorted(labels, key=LaplacianHeads.sort_key)


def _ms(xs: list[Optional[float]], digits: int = 4) -> str:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    if not v:
        return "—"
    m = statistics.fmean(v)
    return f"{m:.{digits}g} ± {statistics.stdev(v):.2g}" if len(v) > 1 else f"{m:.{digits}g}"


def _delta(c, digits: int = 3) -> str:
    if c.p is None:
        return f"{c.diff:+.{digits}g} ({c.verdict})"
    return f"{c.diff:+.{digits}g}, p={c.p:.2g}"


def _groups(runs: list[dict]) -> dict[str, list[dict]]:
    g: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        g[r["label"]].append(r)
    return g


def headline(runs: list[dict]) -> str:
    """Markdown: per setting the task metric and the geometry, mean ± std, Δ vs k=0 and Welch p."""
    key, name, higher = main_metric(runs[0]["recipe"])
    groups = _groups(runs)
    cols = [(key, name, not higher)] + [(k, n, lower) for k, n, lower in GEOMETRY]
    head = ["setting", "runs", "plateaued"]
    for _, n, _ in cols:
        head += [n, "Δ vs k=0, Welch p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = groups.get("k=0", [])
    for label in order(list(groups)):
        rs = groups[label]
        flags = [run_plateau(r).status for r in rs]
        cells = [label, str(len(rs)), f"{flags.count('yes')}/{len(rs)}"]
        for k, _, want_lower in cols:
            vals = [run_value(r, k) for r in rs]
            cells.append(_ms(vals))
            if label == "k=0" or not base:
                cells.append("—")
            else:
                cells.append(_delta(compare("k=0", [run_value(r, k) for r in base], label, vals, want_lower)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def contrasts(runs: list[dict]) -> str:
    """Markdown: each fixed ablation against the Laplacian setting of the same heads, on the task metric."""
    key, name, higher = main_metric(runs[0]["recipe"])
    groups = _groups(runs)
    lines = [
        f"| ablation | against | {name}: Δ [95% CI], Welch p | paired by seed: mean Δ, p (seeds) |",
        "|---|---|---|---|",
    ]
    pairs = [(lb, "k=0") for lb in order(list(groups)) if lb.startswith("k=") and lb != "k=0"] + [("all", "k=0")]
    for label in order(list(groups)):
        spec = LaplacianHeads(label) if label.split(":")[0] in ("identity", "negated") else None
        if spec is None:
            continue
        k = label.split(":")[1]
        lap = "all" if f"k={k}" not in groups and "all" in groups and f"identity:{k}" in groups else f"k={k}"
        pairs += [(label, lap), (label, "k=0")]
    pairs += [("diff", "k=0"), ("xsa", "k=0")]
    for other, base in pairs:
        if other not in groups or base not in groups:
            continue
        c = compare(
            base,
            [run_value(r, key) for r in groups[base]],
            other,
            [run_value(r, key) for r in groups[other]],
            not higher,
        )
        cell = (
            f"{c.diff:+.4f} [{c.ci_low:+.4f}, {c.ci_high:+.4f}], p={c.p:.2g}"
            if c.p is not None
            else f"{c.diff:+.4f} ({c.verdict})"
        )
        lines.append(f"| {other} | {base} | {cell} | {_paired(groups[base], groups[other], key)} |")
    return "\n".join(lines)


def _paired(base: list[dict], other: list[dict], key: str) -> str:
    """Mean difference over the seeds both settings ran and the paired t-test's p (scipy's
    ``ttest_rel``). A seed fixes the initialisation stream and the data order, so runs of one seed
    share them; the paired test removes that shared part of the spread, which Welch's test keeps."""
    from scipy import stats

    a = {r["seed"]: run_value(r, key) for r in base}
    b = {r["seed"]: run_value(r, key) for r in other}
    seeds = sorted(s for s in a.keys() & b.keys() if a[s] is not None and b[s] is not None)
    if len(seeds) < 2:
        return "—"
    d = [b[s] - a[s] for s in seeds]
    if all(x == d[0] for x in d):  # identical differences (e.g. all 0: the same runs bit for bit)
        return f"{d[0]:+.4f} every seed ({len(seeds)})"
    p = stats.ttest_rel([b[s] for s in seeds], [a[s] for s in seeds]).pvalue
    return f"{statistics.fmean(d):+.4f}, p={p:.2g} ({len(seeds)})"


def runs_table(runs: list[dict]) -> str:
    """Markdown: every run's final metric and plateau flag, per setting and seed."""
    key, name, _ = main_metric(runs[0]["recipe"])
    groups = _groups(runs)
    seeds = sorted({r["seed"] for r in runs})
    lines = ["| setting | " + " | ".join(f"seed {s}: {name} (plateau)" for s in seeds) + " |"]
    lines.append("|---" * (1 + len(seeds)) + "|")
    for label in order(list(groups)):
        by_seed = {r["seed"]: r for r in groups[label]}
        cells = [label]
        for s in seeds:
            r = by_seed.get(s)
            v = run_value(r, key) if r else None
            cells.append("—" if v is None else f"{v:.4f} ({run_plateau(r).describe()})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _zoom(ax: Any, labels: list[str], values: list[list[Optional[float]]], groups: dict) -> None:
    """Zoom the metric's axis on the settings within 20% of k=0's mean; the others get their mean
    written at the edge (the identity-only model sits at chance, far below the rest)."""
    means = {lb: statistics.fmean([v for v in vs if v is not None]) for lb, vs in zip(labels, values) if any(vs)}
    ref = means.get("k=0", statistics.median(means.values()))
    near = [v for lb, vs in zip(labels, values) if abs(means.get(lb, ref) - ref) <= 0.2 * abs(ref) for v in vs if v]
    lo, hi = min(near), max(near)
    pad = 0.15 * (hi - lo + 1e-9)
    ax.set_ylim(lo - pad, hi + pad)
    for i, lb in enumerate(labels):
        if lb in means and not lo - pad <= means[lb] <= hi + pad:
            edge = lo - pad if means[lb] < lo else hi + pad
            ax.annotate(
                f"{means[lb]:.3g}", (i, edge), ha="center", va="bottom" if means[lb] < lo else "top", fontsize=7
            )


def figure(runs: list[dict], path: Path, title: str) -> None:
    """One panel per quantity (task metric, k99, within-seq frac, CDNV): seeds as dots, the mean as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, name, _ = main_metric(runs[0]["recipe"])
    groups = _groups(runs)
    labels = order(list(groups))
    panels = [(key, name)] + [(k, n) for k, n, _ in GEOMETRY]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, (k, n) in zip(axes.flat, panels):
        for i, label in enumerate(labels):
            vals = [v for v in (run_value(r, k) for r in groups[label]) if v is not None and math.isfinite(v)]
            if not vals:
                continue
            colour = "#4c72b0" if label.startswith(("k=", "all")) else "#dd8452" if ":" in label else "#55a868"
            ax.bar(i, statistics.fmean(vals), color=colour, alpha=0.5)
            ax.plot([i] * len(vals), vals, "k.", ms=5)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(n, fontsize=10)
        if k == key:
            _zoom(ax, labels, [[run_value(r, k) for r in groups[lb]] for lb in labels], groups)
        elif k == "nc_tokens.cdnv":
            ax.set_yscale("log")  # a degenerate setting (identity on every head) sits decades away
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study_dir")
    p.add_argument("--figure", default=None, help="PNG path of the figure")
    p.add_argument("--title", default="ablation study")
    a = p.parse_args(argv)
    runs = collect(a.study_dir)
    print("## Headline\n\n" + headline(runs) + "\n")
    print("## Contrasts\n\n" + contrasts(runs) + "\n")
    print("## Runs\n\n" + runs_table(runs) + "\n")
    if a.figure:
        figure(runs, Path(a.figure), a.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
