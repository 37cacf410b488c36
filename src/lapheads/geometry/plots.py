"""Figures of per-layer geometry (matplotlib, Agg backend, PNG files).

Every function takes one result of :func:`lapheads.geometry.analyze_model` or several as
``{label: result}`` (e.g. ``{"k=0": base, "k=all": lap}``) and returns the path it wrote;
:func:`plot_all` draws them all. Sections missing from a result are not drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Union

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Runs = Mapping[str, Mapping[str, Any]]

__all__ = ["plot_all", "plot_anova", "plot_k99", "plot_spectra", "plot_nc", "plot_cosine"]


def _runs(results: Union[Runs, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    if "layers" in results and "meta" in results:
        return {"run": results}  # a single result
    return dict(results)


def _get(d: Mapping[str, Any], *keys: str) -> Optional[float]:
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return None if d is None or isinstance(d, (dict, list)) else float(d)


def _layers(res: Mapping[str, Any], section: str) -> list[str]:
    return [l for l, v in res["layers"].items() if isinstance(v.get(section), Mapping) and "error" not in v[section]]


def _panels(n: int) -> Any:
    """A figure with one panel per run, sharing the y axis."""
    return plt.subplots(1, n, figsize=(max(4.5, 4.5 * n), 3.6), squeeze=False, sharey=True)


def _save(fig: Any, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / name
    # explicit margins: tight_layout costs seconds per figure on a busy CPU
    fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.28, wspace=0.3)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p


def plot_anova(results: Union[Runs, Mapping[str, Any]], out_dir: Union[str, Path]) -> Path:
    """Stacked bars of ANOVA fractions per layer, one panel per run."""
    runs = _runs(results)
    fig, axes = _panels(len(runs))
    parts = [
        ("frac_within_sequence", "within sequence", "#4c72b0"),
        ("frac_between_sequence_within_class", "between seq., within class", "#dd8452"),
        ("frac_between_class", "between class", "#55a868"),
        ("frac_between_sequence", "between sequences", "#c44e52"),
    ]
    for ax, (label, res) in zip(axes[0], runs.items()):
        layers = _layers(res, "anova")
        has_cls = any(_get(res["layers"][l], "anova", "frac_between_class") is not None for l in layers)
        use = parts[:3] if has_cls else [parts[0], parts[3]]
        bottom = [0.0] * len(layers)
        for key, name, color in use:
            vals = [(_get(res["layers"][l], "anova", key) or 0.0) for l in layers]
            ax.bar(range(len(layers)), vals, bottom=bottom, label=name, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(layers)), layers, rotation=60, fontsize=7)
        ax.set(title=label, ylim=(0, 1))
    axes[0][0].set_ylabel("fraction of total variance")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return _save(fig, Path(out_dir), "anova_fractions.png")


def _lines(
    ax: Any, runs: dict[str, Mapping[str, Any]], section: str, key: str, style: str = "-o", suffix: str = ""
) -> bool:
    drew = False
    for label, res in runs.items():
        layers = list(res["layers"])
        vals = [_get(res["layers"][l], section, key) for l in layers]
        if all(v is None for v in vals):
            continue
        ax.plot(range(len(layers)), [float("nan") if v is None else v for v in vals], style, label=label + suffix, ms=3)
        ax.set_xticks(range(len(layers)), layers, rotation=60, fontsize=7)
        drew = True
    return drew


def plot_k99(results: Union[Runs, Mapping[str, Any]], out_dir: Union[str, Path]) -> Path:
    """k99 (averaged over sequences, solid) and the global k99 (dashed) per layer, runs overlaid."""
    runs = _runs(results)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    _lines(ax, runs, "spectra", "k_mean", "-o", " per-sequence")
    _lines(ax, runs, "spectra", "global_k", "--s", " global")
    thrs = [_get(v, "spectra", "threshold") for r in runs.values() for v in r["layers"].values()]
    thr = next((t for t in thrs if t), 0.99)
    ax.set_ylabel(f"k{round(100 * thr)} (components)")
    ax.legend(fontsize=7)
    return _save(fig, Path(out_dir), "k99.png")


def plot_spectra(results: Union[Runs, Mapping[str, Any]], out_dir: Union[str, Path]) -> Path:
    """Normalised eigenvalue decay (log scale) per layer: per-sequence mean (solid), global (dotted)."""
    runs = _runs(results)
    fig, axes = _panels(len(runs))
    for ax, (label, res) in zip(axes[0], runs.items()):
        cmap = plt.get_cmap("viridis")
        for i, (l, lres) in enumerate(res["layers"].items()):
            sp = lres.get("spectra") or {}
            c = cmap(i / max(1, len(res["layers"]) - 1))
            for key, ls in (("sequence_curve", "-"), ("global_curve", ":")):
                curve = [v for v in (sp.get(key) or []) if v and v > 0]
                name = l if key == "sequence_curve" or "sequence_curve" not in sp else None
                if curve:
                    ax.semilogy(range(1, len(curve) + 1), curve, ls, color=c, label=name)
        ax.set(title=label, xlabel="component")
        ax.legend(fontsize=6, ncol=2)
    axes[0][0].set_ylabel("eigenvalue / sum")
    return _save(fig, Path(out_dir), "spectra.png")


NC_KEYS = [
    ("nc1", "NC1 tr(Sw Sb+)/C"),
    ("cdnv", "CDNV"),
    ("nc2_equinorm", "NC2 equinorm (CV)"),
    ("nc2_equiangular_std", "NC2 equiangular (std cos)"),
    ("nc2_etf_distance", "NC2 distance to ETF"),
]


def plot_nc(results: Union[Runs, Mapping[str, Any]], out_dir: Union[str, Path]) -> Path:
    """NC metrics per layer: tokens (solid), sequence means (dashed), CLS (dotted); runs overlaid."""
    runs = _runs(results)
    fig, axes = plt.subplots(1, len(NC_KEYS), figsize=(3.4 * len(NC_KEYS), 3.4))
    for ax, (key, title) in zip(axes, NC_KEYS):
        drew = _lines(ax, runs, "nc_tokens", key, "-o", " tokens")
        drew |= _lines(ax, runs, "nc_sequence_means", key, "--s", " seq. means")
        drew |= _lines(ax, runs, "nc_cls", key, ":^", " CLS")
        ax.set_title(title, fontsize=9)
        if key in ("nc1", "cdnv") and drew:
            ax.set_yscale("log")
        if not drew:
            ax.text(0.5, 0.5, "no classes", ha="center", va="center", transform=ax.transAxes)
    axes[0].legend(fontsize=6)
    return _save(fig, Path(out_dir), "neural_collapse.png")


def plot_cosine(results: Union[Runs, Mapping[str, Any]], out_dir: Union[str, Path]) -> Path:
    """Mean within-sequence pairwise cosine per layer, runs overlaid."""
    runs = _runs(results)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    _lines(ax, runs, "cosine", "cosine_mean")
    ax.set_ylabel("mean pairwise cosine (within sequence)")
    ax.legend(fontsize=7)
    return _save(fig, Path(out_dir), "cosine.png")


def plot_all(results: Union[Runs, Mapping[str, Any]], out_dir: Union[str, Path]) -> list[Path]:
    """Every figure; returns the paths written."""
    return [f(results, out_dir) for f in (plot_anova, plot_k99, plot_spectra, plot_nc, plot_cosine)]
