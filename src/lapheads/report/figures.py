"""The report's figures, drawn with matplotlib (Agg) into PNG files; each ``fig_*`` function returns
the file it wrote, or None when there is nothing to draw. A curve with fewer than
:data:`MIN_CURVE_POINTS` points is drawn as markers; layer axes are integer positions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..data.images import spread_over_classes
from ..errors import ConfigError
from ..geometry import pca_rgb
from ..heads import laplacianness, suggest_selection
from ..recipes import get_recipe
from ..vision.transforms import to_float_image
from .collect import geo_value, grid_points, last_block, last_block_value, main_metric

MIN_CURVE_POINTS = 3  # fewer points per run: markers, and no figure when every series is that short


def pyplot():
    """matplotlib's pyplot on the Agg backend (imported here: plotting code only)."""
    from ..geometry.plots import plt  # lazy: it chooses the Agg backend before pyplot loads

    return plt


def layer_axis(ax: Any, names: list[str]) -> None:
    """An x axis of layers: integer positions 0..n-1, labelled with the layer names."""
    ax.set_xticks(range(len(names)), names, rotation=45 if len(names) > 4 else 0, fontsize=7)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_xlabel("layer")


def _finish_lines(plt, fig, ax, drawn: bool, path: Path, xlabel: str, ylabel: str, title: str) -> Optional[Path]:
    """Label, save and close a line figure; None (nothing written) when no line was drawn."""
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel(xlabel)
    if xlabel == "optimizer step":
        from matplotlib.ticker import MaxNLocator  # lazy, as pyplot

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    return save(fig, path)


def save(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close a figure; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def curve_series(groups: dict, values: Any) -> list[tuple[str, list[dict[int, float]]]]:
    """``(line label, per-run {step: value})`` for the curve figures, ``values(run)`` giving a run's
    curve: one line per setting and grid point (``k=0 (embed_dim=32)``), runs without a curve left out."""
    runs = [r for g in groups.values() for r in g["runs"]]
    by_grid = grid_points(runs) if runs else {}
    point_of = {r["dir"]: name for name, rs in by_grid.items() for r in rs}
    several = len(by_grid) > 1
    out = []
    for label, g in groups.items():
        by_point: dict[str, list[dict[int, float]]] = {}
        for r in g["runs"]:
            c = values(r)
            if c:
                by_point.setdefault(point_of[r["dir"]], []).append(c)
        for name in (n for n in by_grid if n in by_point):  # axis order
            out.append((f"{label} ({name})" if several else str(label), by_point[name]))
    return out


def _train_loss(run: dict) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in run["train"]}


def _val_metric(key: str) -> Any:
    return lambda run: {r["step"]: float(r[key]) for r in run["val"] if isinstance(r.get(key), (int, float))}


def _draw_curves(groups: dict, values: Any, path: Path, ylabel: str, title: str) -> Optional[Path]:
    """Mean ± std over seeds of each :func:`curve_series` line, at the steps all its runs share
    (markers only below :data:`MIN_CURVE_POINTS` steps; None when every series is that short)."""
    series = []
    for label, curves in curve_series(groups, values):
        steps = sorted(set.intersection(*[set(c) for c in curves]))
        if steps:
            series.append((label, curves, steps))
    if not any(len(steps) >= MIN_CURVE_POINTS for _, _, steps in series):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, curves, steps in series:
        vals = np.array([[c[s] for s in steps] for c in curves])
        mean = vals.mean(0)
        style = "-o" if len(steps) >= MIN_CURVE_POINTS else "o"
        ax.plot(steps, mean, style, ms=3 if len(steps) >= MIN_CURVE_POINTS else 6, label=f"{label} (n={len(curves)})")
        if len(curves) > 1:
            sd = vals.std(0, ddof=1)
            ax.fill_between(steps, mean - sd, mean + sd, alpha=0.2)
    return _finish_lines(plt, fig, ax, True, path, "optimizer step", ylabel, title)


def curve_note(groups: dict, recipe: str, which: str) -> str:
    """The sentence that stands for a curve figure left out: ``which`` is ``"loss"`` (training loss)
    or ``"val"`` (the validation metric); empty when no run logged a single point."""
    m = main_metric(recipe)
    values = _train_loss if which == "loss" else (_val_metric(m.key) if m else None)
    if values is None:
        return ""
    counts = sorted({len(values(r)) for g in groups.values() for r in g["runs"]} - {0})
    if not counts:
        return ""
    what = "Training loss" if which == "loss" else f"Validation metric ({m.label})"
    knob = "train.log_every" if which == "loss" else "train.eval_every"
    points = " to ".join(map(str, dict.fromkeys([counts[0], counts[-1]])))
    return (
        f"{what}: logged at {points} step(s) per run, fewer than {MIN_CURVE_POINTS}, so no curve is "
        f"drawn (a smaller {knob} logs more)."
    )


def fig_curves(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    """Training loss per step, mean ± std over the seeds of each setting."""
    return _draw_curves(groups, _train_loss, path, "training loss", f"{recipe}: training loss (mean ± std over seeds)")


def fig_val_curves(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    """The validation metric at every eval point, mean ± std over the seeds of each setting."""
    m = main_metric(recipe)
    if m is None:
        return None
    title = f"{recipe}: validation {m.label} (mean ± std over seeds)"
    return _draw_curves(groups, _val_metric(m.key), path, m.label, title)


def fig_metric(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    """The main metric per setting: mean ± std bars, each seed a dot."""
    m = main_metric(recipe)
    if m is None:
        return None
    labels = [lb for lb, g in groups.items() if g[m.key][2] > 0]
    if not labels:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    means = [groups[lb][m.key][0] for lb in labels]
    stds = [groups[lb][m.key][1] for lb in labels]
    ax.bar(labels, means, yerr=stds, capsize=4, color="#4c72b0")
    for lb in labels:  # the individual seeds
        xs = [r["final"].get(m.key) for r in groups[lb]["runs"] if r["final"].get(m.key) is not None]
        ax.scatter([lb] * len(xs), xs, color="k", s=10, zorder=3)
    lo, hi = min(means) - 3 * max(max(stds), 1e-3), max(means) + 3 * max(max(stds), 1e-3)
    ax.set(ylim=(lo, hi), ylabel=m.label, title=f"{recipe}: {m.label} per Laplacian-head setting")
    return save(fig, path)


def fig_layers(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    """ANOVA fractions, k99 and cosine per layer, one line per setting (mean ± std over seeds)."""
    panels = [
        ("anova", "frac_within_sequence", "within-sequence fraction"),
        ("anova", "frac_between_class", "between-class fraction"),
        ("spectra", "k_mean", "k99 (per sequence)"),
        ("cosine", "cosine_mean", "mean within-sequence cosine"),
    ]
    geos_all = [r["geometry"] for g in groups.values() for r in g["runs"] if r["geometry"]]
    if not geos_all:
        return None
    panels = [p for p in panels if any(last_block_value(geo, p[0], p[1]) is not None for geo in geos_all)]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
    for ax, (section, key, title) in zip(axes[0], panels):
        names: list[str] = []
        for label, g in groups.items():
            geos = [r["geometry"] for r in g["runs"] if r["geometry"]]
            if not geos:
                continue
            layers = [n for n in geos[0]["layers"] if n != "pre_logits"]
            names = layers if len(layers) > len(names) else names
            vals = np.array([[geo_value(gg, n, section, key) or np.nan for n in layers] for gg in geos])
            m = np.nanmean(vals, 0)
            ax.plot(range(len(layers)), m, "-o", ms=3, label=label)
            if len(geos) > 1:
                sd = np.nanstd(vals, 0, ddof=1)
                ax.fill_between(range(len(layers)), m - sd, m + sd, alpha=0.2)
        ax.set_title(title, fontsize=9)
        layer_axis(ax, names)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{recipe}: token geometry per layer (mean ± std over seeds)", fontsize=10)
    return save(fig, path)


def fig_spectra(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    """The per-sequence spectrum of the last block, mean over the seeds of each setting."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    drawn = False
    for label, g in groups.items():
        curves = []
        for r in g["runs"]:
            geo = r["geometry"]
            layer = last_block(geo) if geo else None
            c = geo["layers"][layer].get("spectra", {}).get("sequence_curve") if layer else None
            if c:
                curves.append(np.asarray(c, dtype=float))
        if not curves:
            continue
        n = min(len(c) for c in curves)
        m = np.mean([c[:n] for c in curves], 0)
        n = max(1, int((m > 1e-9).sum()))  # beyond the rank (tokens per sequence) only round-off is left
        ax.semilogy(np.arange(1, n + 1), m[:n], "-o", ms=2, label=label)
        drawn = True
    title = f"{recipe}: per-sequence spectrum, last block"
    return _finish_lines(plt, fig, ax, drawn, path, "principal component", "fraction of variance", title)


def fig_pca(groups: dict, path: Path, recipe: str = "classify") -> Optional[Path]:
    """PCA maps (top 3 components of patch tokens as RGB) of a few validation images, drawn from several
    classes, per setting: the recipe's backbone of one run on its held-out images and eval transform."""
    reps = [(lb, g["runs"][0]) for lb, g in groups.items() if g["runs"] and g["runs"][0]["finished"]]
    if not reps:
        return None
    rec = get_recipe(recipe)
    first = rec.load_run(reps[0][1]["dir"])
    ds = rec.eval_dataset(first.config)
    labels = getattr(ds, "targets", None)
    idx = spread_over_classes(list(labels), 6) if labels is not None else list(range(min(6, len(ds))))
    imgs = torch.stack([first.transform(ds[i][0]) for i in idx])
    plt = pyplot()
    fig, axes = plt.subplots(len(reps) + 1, len(idx), figsize=(1.3 * len(idx), 1.35 * (len(reps) + 1)), squeeze=False)
    for j, i in enumerate(idx):
        axes[0][j].imshow(to_float_image(ds[i][0]).permute(1, 2, 0).numpy())  # RGB inputs in colour
        axes[0][j].set_axis_off()
    axes[0][0].set_title("input", fontsize=7, loc="left")
    for row, (label, r) in enumerate(reps, start=1):
        model, _meta = rec.load_backbone(r["dir"])
        with torch.no_grad():
            toks = model.forward_intermediates(
                imgs, indices=[len(model.blocks) - 1], intermediates_only=True, output_fmt="NLC"
            )[-1]
        side = int(round(math.sqrt(toks.shape[1])))  # forward_intermediates drops the CLS/register tokens
        rgb = pca_rgb(toks, (side, side))
        for j in range(len(idx)):
            axes[row][j].imshow(rgb[j], interpolation="nearest")
            axes[row][j].set_axis_off()
        axes[row][0].set_title(label, fontsize=7, loc="left")
    fig.suptitle("PCA maps of last-block patch tokens (one seed per setting)", fontsize=8)
    return save(fig, path)


def learned_mixing(groups: dict, path: Path) -> Optional[tuple[Path, list[str]]]:
    """Heatmaps of the learned head mixing and a suggested fixed selection per setting, or None.

    One heatmap (layers x heads) per run whose final metrics hold ``lap_mix``
    (:func:`lapheads.heads.mixing_table`), coloured by :func:`lapheads.heads.laplacianness` (0 =
    standard ``P``, 1 = Laplacian ``I - P``); per setting, the heads whose Laplacian-ness averaged
    over seeds is nearer the Laplacian (:func:`lapheads.heads.suggest_selection`). Returns
    ``(figure path, lines of text)``.
    """
    panels = [
        (label, r)
        for label, g in groups.items()
        for r in g["runs"]
        if isinstance(r.get("final", {}).get("lap_mix"), list) and r["final"]["lap_mix"]
    ]
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
    im = None
    for ax, (label, r) in zip(axes[0], panels):
        grid = np.array(
            [[laplacianness(a, b) for a, b in zip(row["a"], row["b"])] for row in r["final"]["lap_mix"]], dtype=float
        )
        im = ax.imshow(grid, cmap="coolwarm", vmin=-0.5, vmax=1.5, aspect="auto")  # centred on the 0.5 boundary
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(f"{label} seed {r['seed']}", fontsize=9)
        ax.set(xlabel="head", ylabel="layer", xticks=range(grid.shape[1]), yticks=range(grid.shape[0]))
    fig.colorbar(im, ax=axes[0].tolist(), label="Laplacian-ness (0 standard, 1 Laplacian)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    lines = []
    for label in dict.fromkeys(lb for lb, _ in panels):
        tables = [r["final"]["lap_mix"] for lb, r in panels if lb == label]
        try:
            sel = suggest_selection(tables)
        except ConfigError as e:
            lines.append(f"{label}: no suggestion ({e})")
            continue
        counts = [len(s) for s in sel]
        lines.append(
            f"{label}: suggested fixed selection from {len(tables)} run(s): laplacian_heads={sel} "
            f"(Laplacian heads per layer {counts}; a head is Laplacian when its mean Laplacian-ness "
            "-atan(a/b)/45deg puts it nearer I - P than P)"
        )
    return path, lines
