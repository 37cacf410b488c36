"""``lapheads report RUN_DIR [RUN_DIR ...]``: compare runs, grouped by their Laplacian heads.

Writes ``report.md`` (figures beside it in ``figures/``) and a self-contained ``report.html``
(the same figures embedded as data URIs), both rendered from one model (see "Design" below). For
every recipe present:

* a table with one row per Laplacian-head setting: runs, how many plateaued, the recipe's metrics
  and the geometry of the last block (NC1 also at the classifier input) as mean +- std over seeds;
* figures: training loss and validation-metric curves (mean +- std over seeds), the main metric per
  setting, ANOVA fractions / k99 / cosine per layer, singular-value spectra, and (vision) PCA maps
  of images drawn from several classes (inputs shown in colour when they are RGB);
* one paragraph per claim of the paper, comparing every setting with the baseline (k=0): the
  difference with its 95% confidence interval, Welch's t and p and the seeds per setting
  (:mod:`lapheads.stats`). A verdict is "observed" / "opposite" only at p < 0.05, otherwise "not
  resolved" with the seeds such an effect would need; one seed per setting is a "single run" (no
  test). A paragraph says when runs it compares had not plateaued.
* a table of the runs with a plateau flag each: the relative change of the validation metric over
  the last ``--plateau-window`` fraction of training, below ``--plateau-tol`` = plateaued, fewer
  than three eval points = unknown (set ``train.eval_every``); a run stopped by
  ``train.until_plateau`` counts as plateaued (:func:`lapheads.stats.plateau`).

``summary.json`` holds, per recipe and setting, the mean / std / n of every number, the per-run
plateau flags and, for each setting other than k=0, the comparisons with k=0 (the same numbers as
the paragraphs). Integers are printed as integers (``n=10000``).

Design: the report is built once, as a data model (:class:`Report`: sections holding tables of
formatted cells that keep their raw numbers, claim verdicts with their statistics, figures by path
relative to the report), by :func:`make_report`, which also draws the figures. Two Jinja2
templates shipped in the package (``lapheads/templates/report.md.j2`` and ``report.html.j2``)
render that one model (:func:`render_markdown`, :func:`render_html`), so both files always show
the same sections, numbers and figures; all wording and every number is decided in Python, the
templates only lay it out. The HTML template autoescapes; the Markdown one escapes ``|`` in table
cells. The HTML embeds each figure as a data URI (the page is one file that can be mailed), and
names its file in ``data-file``.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .data.images import spread_over_classes
from .engine.run import RESUME_MUTABLE, RunDir, flatten_config
from .errors import ConfigError
from .geometry import pca_rgb
from .heads import LaplacianHeads, laplacianness, suggest_selection
from .outputs import read_json
from .recipes import get_recipe
from .runs import load_geometry
from .stats import Comparison, Plateau, compare, plateau
from .variants import variant_label
from .vision.transforms import to_float_image

# recipe -> [(metric key in final/metrics.json, label, higher is better)]
METRICS = {
    "classify": [
        ("top1", "top-1 acc", True),
        ("top5", "top-5 acc", True),
        ("mean_class_acc", "mean class acc", True),
        ("loss", "val loss", False),
    ],
    "lm": [("val_bpb", "val bits/byte", False), ("val_loss", "val loss", False)],
    "sft": [("val_loss", "val loss (assistant tokens)", False)],
    # the keys DINO's evaluation logs (knn_classify: knn_k{k}_top1 for the default knn.ks = [10, 20])
    "dino": [("knn_k20_top1", "20-NN top-1", True), ("knn_k10_top1", "10-NN top-1", True)],
}
METRICS["retrofit_vit"] = METRICS["classify"]  # a retrofitted ViT is evaluated by the classify task
# geometry numbers summarised in the table: (summary key, layer, section, field, label). Layer
# "last": the last transformer block; "classifier": the features the classifier reads (the run's
# meta.classifier_layer, else pre_logits, else the last block).
GEOMETRY = [
    ("anova.frac_within_sequence", "last", "anova", "frac_within_sequence", "within-seq frac"),
    ("anova.frac_between_class", "last", "anova", "frac_between_class", "between-class frac"),
    ("spectra.k_mean", "last", "spectra", "k_mean", "k99"),
    ("cosine.cosine_mean", "last", "cosine", "cosine_mean", "cosine"),
    ("nc_sequence_means.nc1", "last", "nc_sequence_means", "nc1", "NC1 (seq means)"),
    ("classifier_input.nc1", "classifier", "nc_tokens", "nc1", "NC1 (classifier input)"),
    ("nc_tokens.cdnv", "last", "nc_tokens", "cdnv", "CDNV (tokens)"),
]
_GEO = {key: (where, section, field) for key, where, section, field, _ in GEOMETRY}


# ----------------------------------------------------------------------------------- collection
def collect_run(run_dir: Path) -> dict[str, Any]:
    run = RunDir(run_dir)
    cfg = run.read_config()
    spec = get_recipe(cfg["recipe"]).heads(run.path)  # the recipe's one rule (SFT: its pretraining run's)
    label = LaplacianHeads(spec).label()
    if label == "none":
        label = "k=0"
    # another attention (diff, xsa) is its own group; standard attention is k=0
    label = variant_label((cfg.get("model") or {}).get("attention", "laplacian"), label)
    final = run.final_dir / "metrics.json"
    records = run.metrics()
    return {
        "dir": str(run.path),
        "name": run.path.name,
        "recipe": cfg["recipe"],
        "label": label,
        "seed": (cfg.get("train") or {}).get("seed", 0),
        "final": read_json(final, "the final metrics of a run") if final.is_file() else {},
        "finished": (run.final_dir / "model.json").is_file(),
        "train": [r for r in records if "loss" in r and r.get("split") is None],
        "val": [r for r in records if r.get("split") == "val"],
        "plateau_stop": next((r["step"] for r in records if r.get("event") == "until_plateau_stop"), None),
        "geometry": load_geometry(run.path),
    }


def _last_block(geo: dict) -> Optional[str]:
    names = [n for n in geo.get("layers", {}) if n != "pre_logits"]
    return names[-1] if names else None


def _classifier_layer(geo: dict) -> Optional[str]:
    layer = (geo.get("meta") or {}).get("classifier_layer")
    if layer in geo.get("layers", {}):
        return layer
    return "pre_logits" if "pre_logits" in geo.get("layers", {}) else _last_block(geo)


def _geo_value(geo: Optional[dict], layer: Optional[str], section: str, key: str) -> Optional[float]:
    if not geo or layer is None:
        return None
    v = geo["layers"].get(layer, {}).get(section, {}).get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def run_value(run: dict, key: str) -> Optional[float]:
    """One run's number for a summary key: a final metric or a geometry key of :data:`GEOMETRY`."""
    if key in _GEO:
        where, section, field = _GEO[key]
        geo = run["geometry"]
        if not geo:
            return None
        return _geo_value(geo, _last_block(geo) if where == "last" else _classifier_layer(geo), section, field)
    v = run["final"].get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def main_metric(recipe: str) -> Optional[tuple[str, str, bool]]:
    """(key, label, higher is better) of the recipe's validation metric (curves and plateau flags)."""
    return METRICS[recipe][0] if METRICS.get(recipe) else None


def run_plateau(run: dict, window: float = 0.2, tol: float = 0.01) -> Plateau:
    """Plateau flag of a run's validation curve of its recipe's main metric (:func:`lapheads.stats.plateau`)."""
    m = main_metric(run["recipe"])
    pts = [(r["step"], r[m[0]]) for r in run["val"] if m and isinstance(r.get(m[0]), (int, float))]
    return plateau([s for s, _ in pts], [v for _, v in pts], window, tol, stopped_at=run.get("plateau_stop"))


def _mean_std(xs: list[float]) -> tuple[float, float, int]:
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan"), 0
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0, int(a.size)


def _num(x: Any, digits: int = 4) -> str:
    """A number for people: integers (and integral values) in full (``10000``, never ``1e+04``),
    other values to ``digits`` significant digits, large ones rounded to an integer."""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    if abs(x) < 1e15 and (x.is_integer() or abs(x) >= 10**digits):
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _fmt(m: float, s: float, n: int, digits: int = 4) -> str:
    if n == 0 or not math.isfinite(m):
        return "-"
    return f"{_num(m, digits)} ± {_num(s, 2)}" if n > 1 else _num(m, digits)


def summarise(runs: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """recipe -> label -> {"runs": [...], metric/geometry key -> (mean, std, n)}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["recipe"], {}).setdefault(r["label"], {"runs": []})["runs"].append(r)
    for recipe, groups in out.items():
        for g in groups.values():
            for key, _, _ in METRICS.get(recipe, []):
                g[key] = _mean_std([run_value(r, key) for r in g["runs"]])
            for key, *_ in GEOMETRY:
                g[key] = _mean_std([run_value(r, key) for r in g["runs"]])
        out[recipe] = dict(sorted(groups.items(), key=lambda kv: LaplacianHeads.sort_key(kv[0])))
    return out


# ----------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib  # lazy: the Agg backend must be chosen before pyplot loads; plotting code only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: the Agg backend must be chosen before pyplot loads; plotting code only

    return plt


def _finish_lines(plt, fig, ax, drawn: bool, path: Path, xlabel: str, ylabel: str, title: str) -> Optional[Path]:
    """Label, save and close a line figure; None (nothing written) when no line was drawn."""
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curve_series(groups: dict, values: Any) -> list[tuple[str, list[dict[int, float]]]]:
    """``(line label, per-run {step: value})`` for the curve figures: one line per setting and grid point.

    ``values(run)`` gives a run's curve. The runs of a setting (k) are split by grid point
    (:func:`grid_points`): a sweep over widths or lengths then draws ``k=0 (embed_dim=32)`` and
    ``k=0 (embed_dim=64)``, never a mean ± std pooled over points whose curves differ by design.
    Runs without a curve are left out.
    """
    runs = [r for g in groups.values() for r in g["runs"]]
    by_grid = grid_points(runs) if runs else {}
    rank = {name: i for i, name in enumerate(by_grid)}  # axis order
    point_of = {r["dir"]: name for name, rs in by_grid.items() for r in rs}
    several = len(by_grid) > 1
    out = []
    for label, g in groups.items():
        by_point: dict[str, list[dict[int, float]]] = {}
        for r in g["runs"]:
            c = values(r)
            if c:
                by_point.setdefault(point_of[r["dir"]], []).append(c)
        for name in sorted(by_point, key=rank.__getitem__):
            out.append((f"{label} ({name})" if several else str(label), by_point[name]))
    return out


def _draw_curves(groups: dict, values: Any, path: Path, ylabel: str, title: str, style: str) -> Optional[Path]:
    """Mean ± std over seeds of each :func:`curve_series` line, at the steps all its runs share."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    drawn = False
    for label, curves in curve_series(groups, values):
        steps = sorted(set.intersection(*[set(c) for c in curves]))
        if not steps:
            continue
        vals = np.array([[c[s] for s in steps] for c in curves])
        mean = vals.mean(0)
        ax.plot(steps, mean, style, ms=3, label=f"{label} (n={len(curves)})")
        if len(curves) > 1:
            sd = vals.std(0, ddof=1)
            ax.fill_between(steps, mean - sd, mean + sd, alpha=0.2)
        drawn = True
    return _finish_lines(plt, fig, ax, drawn, path, "optimizer step", ylabel, title)


def _fig_curves(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    return _draw_curves(
        groups,
        lambda run: {x["step"]: x["loss"] for x in run["train"]},
        path,
        "training loss",
        f"{recipe}: training loss (mean ± std over seeds)",
        "-",
    )


def _fig_val_curves(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    """The validation metric at every eval point, mean ± std over the seeds of each setting.

    Drawn at the eval steps all seeds of a setting share; a run evaluated only at the end is one
    marker (set ``train.eval_every`` for curves and plateau flags)."""
    m = main_metric(recipe)
    if m is None:
        return None
    key, name, _ = m
    return _draw_curves(
        groups,
        lambda run: {r["step"]: float(r[key]) for r in run["val"] if isinstance(r.get(key), (int, float))},
        path,
        name,
        f"{recipe}: validation {name} (mean ± std over seeds)",
        "-o",
    )


def _fig_metric(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    metrics = METRICS.get(recipe, [])
    if not metrics:
        return None
    key, name, _ = metrics[0]
    labels = [lb for lb, g in groups.items() if g[key][2] > 0]
    if not labels:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    means = [groups[lb][key][0] for lb in labels]
    stds = [groups[lb][key][1] for lb in labels]
    ax.bar(labels, means, yerr=stds, capsize=4, color="#4c72b0")
    for lb in labels:  # the individual seeds
        xs = [r["final"].get(key) for r in groups[lb]["runs"] if r["final"].get(key) is not None]
        ax.scatter([lb] * len(xs), xs, color="k", s=10, zorder=3)
    lo, hi = min(means) - 3 * max(max(stds), 1e-3), max(means) + 3 * max(max(stds), 1e-3)
    ax.set_ylim(lo, hi)
    ax.set_ylabel(name)
    ax.set_title(f"{recipe}: {name} per Laplacian-head setting")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_layers(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    panels = [
        ("anova", "frac_within_sequence", "within-sequence fraction"),
        ("anova", "frac_between_class", "between-class fraction"),
        ("spectra", "k_mean", "k99 (per sequence)"),
        ("cosine", "cosine_mean", "mean within-sequence cosine"),
    ]
    any_geo = any(r["geometry"] for g in groups.values() for r in g["runs"])
    if not any_geo:
        return None
    panels = [
        p
        for p in panels
        if any(
            _geo_value(r["geometry"], _last_block(r["geometry"]), p[0], p[1]) is not None
            for g in groups.values()
            for r in g["runs"]
            if r["geometry"]
        )
    ]
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
    for ax, (section, key, title) in zip(axes[0], panels):
        for label, g in groups.items():
            geos = [r["geometry"] for r in g["runs"] if r["geometry"]]
            if not geos:
                continue
            layers = [n for n in geos[0]["layers"] if n != "pre_logits"]
            vals = np.array([[_geo_value(gg, n, section, key) or np.nan for n in layers] for gg in geos])
            m = np.nanmean(vals, 0)
            ax.plot(range(len(layers)), m, "-o", ms=3, label=label)
            if len(geos) > 1:
                sd = np.nanstd(vals, 0, ddof=1)
                ax.fill_between(range(len(layers)), m - sd, m + sd, alpha=0.2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{recipe}: token geometry per layer (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_spectra(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    drawn = False
    for label, g in groups.items():
        curves = []
        for r in g["runs"]:
            geo = r["geometry"]
            layer = _last_block(geo) if geo else None
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
    return _finish_lines(
        plt,
        fig,
        ax,
        drawn,
        path,
        "principal component",
        "fraction of variance",
        f"{recipe}: per-sequence spectrum, last block",
    )


def _fig_pca(groups: dict, path: Path, recipe: str = "classify") -> Optional[Path]:
    """PCA maps (top 3 components of patch tokens as RGB) of a few validation images per setting.

    The recipe's backbone of each run (``classify``: the ViT without its classifier; ``dino``: the
    teacher) on its held-out images with its evaluation transform (the in_chans of a greyscale
    model included).
    """
    reps = [(lb, g["runs"][0]) for lb, g in groups.items() if g["runs"] and g["runs"][0]["finished"]]
    if not reps:
        return None
    rec = get_recipe(recipe)
    first = rec.load_run(reps[0][1]["dir"])
    ds = rec.eval_dataset(first.config)
    tf = first.transform
    labels = getattr(ds, "targets", None)  # one image from each of several classes, not the first six
    idx = spread_over_classes(list(labels), 6) if labels is not None else list(range(min(6, len(ds))))
    imgs = torch.stack([tf(ds[i][0]) for i in idx])
    plt = _plt()
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
        patches = toks  # forward_intermediates drops the CLS/register tokens by default
        side = int(round(math.sqrt(patches.shape[1])))
        rgb = pca_rgb(patches, (side, side))
        for j in range(len(idx)):
            axes[row][j].imshow(rgb[j], interpolation="nearest")
            axes[row][j].set_axis_off()
        axes[row][0].set_title(label, fontsize=7, loc="left")
    fig.suptitle("PCA maps of last-block patch tokens (one seed per setting)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- claims
# (summary key, the claim predicts lower values with Laplacian heads, claim, how it is measured)
CLAIMS = [
    (
        "anova.frac_within_sequence",
        True,
        "Laplacian heads shrink the within-sequence variance",
        "within-sequence fraction of the token variance, last block",
    ),
    (
        "anova.frac_between_class",
        False,
        "Laplacian heads grow the between-class variance",
        "between-class fraction of the token variance, last block",
    ),
    (
        "spectra.k_mean",
        True,
        "Laplacian heads make spectra decay faster (lower k99)",
        "components for 99% of a sequence's variance, last block",
    ),
    (
        "nc_tokens.cdnv",
        True,
        "Laplacian heads make classes more separable (lower CDNV)",
        "CDNV of tokens by class (next token for a language model), last block",
    ),
    (
        "nc_sequence_means.nc1",
        True,
        "Laplacian heads strengthen neural collapse of image/sequence means (lower NC1)",
        "NC1 = tr(Sigma_W pinv(Sigma_B)) / C of the image (sequence) means by class, last block",
    ),
    (
        "classifier_input.nc1",
        True,
        "Laplacian heads strengthen neural collapse at the classifier input (lower NC1)",
        "NC1 of the features the classifier reads (pre-logits for a ViT; the last hidden state's tokens by "
        "next token for a language model)",
    ),
]


def comparisons(groups: dict, key: str, want_lower: bool) -> list[Comparison]:
    """Every setting with data against the baseline k=0 (none without a baseline)."""
    if "k=0" not in groups:
        return []
    base = [run_value(r, key) for r in groups["k=0"]["runs"]]
    out = []
    for label, g in groups.items():
        if label == "k=0":
            continue
        c = compare("k=0", base, label, [run_value(r, key) for r in g["runs"]], want_lower)
        if c.verdict != "no data":
            out.append(c)
    return out if any(c.n_baseline for c in out) else []


def _convergence_note(groups: dict, labels: Sequence[str], flags: dict[str, Plateau]) -> str:
    """Empty when every compared run had plateaued, else which had not (or are unknown)."""
    runs = [r for lb in labels for r in groups[lb]["runs"]]
    names = [r["name"] for r in runs]
    no = [r["name"] for r in runs if flags[r["dir"]].status == "no"]
    unknown = [r["name"] for r in runs if flags[r["dir"]].status == "unknown"]
    parts = []
    if no:
        parts.append(
            f"{len(no)} of {len(names)} runs compared had not plateaued ({', '.join(no)}): "
            "this compares unconverged runs"
        )
    if unknown:
        parts.append(
            f"convergence unknown for {len(unknown)} of {len(names)} runs (fewer than 3 validation "
            "points; set train.eval_every)"
        )
    return "; ".join(parts)


def claims(summary: dict, flags: Optional[dict[str, Plateau]] = None) -> list[dict[str, Any]]:
    """One entry per (recipe, claim) with data: ``{"recipe", "key", "claim", "how", "want_lower",
    "comparisons": [Comparison], "convergence": str, "text": str}``."""
    flags = (
        flags
        if flags is not None
        else {r["dir"]: run_plateau(r) for gs in summary.values() for g in gs.values() for r in g["runs"]}
    )
    out = []
    for recipe, groups in summary.items():
        spec = list(CLAIMS)
        m = main_metric(recipe)
        if m is not None:
            key, name, higher = m
            spec.append(
                (
                    key,
                    not higher,
                    "Laplacian heads raise the accuracy" if higher else f"Laplacian heads lower the {name}",
                    name,
                )
            )
        for key, lower, what, how in spec:
            comps = comparisons(groups, key, lower)
            if not comps:
                continue
            conv = _convergence_note(groups, ["k=0"] + [c.other for c in comps], flags)
            text = f"{how[0].upper() + how[1:]}. " + "; ".join(c.describe() for c in comps) + "."
            if conv:
                text += f" Convergence: {conv}."
            out.append(
                {
                    "recipe": recipe,
                    "key": key,
                    "claim": f"{recipe}: {what}",
                    "how": how,
                    "want_lower": lower,
                    "comparisons": comps,
                    "convergence": conv,
                    "text": text,
                }
            )
    return out


def grid_points(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """The runs of ONE recipe by grid point (one combination of :func:`grid_axes`), in axis order.

    Keys name the point (``"embed_dim=32, epochs=5"``); runs that differ only in k and seed share a
    point. Without grid axes every run is in one point named ``""``.
    """
    configs = [RunDir(r["dir"]).read_config() for r in runs]
    axes = grid_axes(configs)
    points: dict[tuple, list[dict]] = {}
    for r, c in zip(runs, configs):
        f = flatten_config(c)
        points.setdefault(tuple(f.get(a) for a in axes), []).append(r)
    order = sorted(points, key=lambda vs: tuple((0, v, "") if _numeric([v]) else (1, 0, str(v)) for v in vs))
    return {", ".join(f"{a.rsplit('.', 1)[-1]}={v}" for a, v in zip(axes, values)): points[values] for values in order}


def grid_claims(runs: Sequence[dict], flags: dict[str, Plateau]) -> list[dict[str, Any]]:
    """:func:`claims` inside each grid point, for every recipe whose runs differ in config values.

    A grid point is one combination of the grid axes (:func:`grid_axes`); its runs differ only in k
    and seed, so a comparison there is not blurred by the spread between points. Each entry is a
    :func:`claims` entry whose ``claim`` names the point, plus ``"point"`` (``"embed_dim=32, epochs=5"``).
    """
    out: list[dict[str, Any]] = []
    by_recipe: dict[str, list[dict]] = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r)
    for recipe, rs in by_recipe.items():
        points = grid_points(rs)
        if len(points) < 2:
            continue
        for name, point_runs in points.items():
            for c in claims(summarise(point_runs), flags):
                c["claim"] = f"{recipe} at {name}: {c['claim'].split(': ', 1)[1]}"
                c["point"] = name
                out.append(c)
    return out


# ----------------------------------------------------------------------------------- report model
@dataclass
class Cell:
    """One table cell: the text both formats show, and the number(s) it was formatted from.

    ``raw`` is None for a label, a number (a count, a seed, a step, a grid-axis value, a run's
    relative change behind its plateau flag), ``(mean, std, n)`` for a mean ± std over seeds,
    ``(plateaued, runs)`` for the plateau count of a setting, ``{key: value}`` for a run's final
    metrics.
    """

    text: str
    raw: Any = None


@dataclass
class Table:
    """A header and rows of already formatted cells (every row as long as the header)."""

    header: list[str]
    rows: list[list[Cell]]


@dataclass
class Figure:
    """A figure file of the report: ``path`` relative to the report directory (POSIX separators)."""

    path: str
    caption: str
    alt: str


@dataclass
class Verdict:
    """One claim of the paper tested on the runs (:func:`claims`).

    ``measured`` says which number the claim is tested on, ``comparisons`` hold the statistics of
    every setting against k=0 (difference, CI, Welch t and p, seeds, verdict), ``text`` is the
    paragraph both formats show.
    """

    claim: str
    key: str
    measured: str
    comparisons: list[Comparison]
    convergence: str
    text: str


@dataclass
class Section:
    """A headed part of the report, drawn in this order: paragraphs, tables, notes, figures, items
    (a bullet list), verdicts."""

    title: str
    level: int = 2
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)


@dataclass
class Report:
    """Everything the report shows, built once by :func:`make_report` and rendered by
    :func:`render_markdown` / :func:`render_html`; ``summary`` is the content of ``summary.json``."""

    title: str
    paragraphs: list[str]
    sections: list[Section]
    summary: dict[str, Any]

    def tables(self) -> list[Table]:
        return [t for s in self.sections for t in s.tables]

    def figures(self) -> list[Figure]:
        return [f for s in self.sections for f in s.figures]


def _plateaued(runs: list[dict], flags: dict[str, Plateau]) -> Cell:
    st = [flags[r["dir"]].status for r in runs]
    text = f"{st.count('yes')}/{len(st)}"
    return Cell(text + (f" ({st.count('unknown')} unknown)" if "unknown" in st else ""), (st.count("yes"), len(st)))


def _stat_cell(stat: tuple[float, float, int]) -> Cell:
    return Cell(_fmt(*stat), stat)


def _setting_table(recipe: str, groups: dict, flags: dict[str, Plateau]) -> Table:
    """One row per Laplacian-head setting: runs, plateaued, then the metric and geometry columns with data."""
    metrics = [(k, n) for k, n, _ in METRICS.get(recipe, []) if any(g[k][2] for g in groups.values())]
    geo = [(k, n) for k, *_, n in GEOMETRY if any(g[k][2] for g in groups.values())]
    header = ["Laplacian heads", "runs", "plateaued"] + [n for _, n in metrics] + [n for _, n in geo]
    rows = [
        [Cell(label), Cell(str(len(g["runs"])), len(g["runs"])), _plateaued(g["runs"], flags)]
        + [_stat_cell(g[k]) for k, _ in metrics]
        + [_stat_cell(g[k]) for k, _ in geo]
        for label, g in groups.items()
    ]
    return Table(header, rows)


def _runs_table(runs: list[dict], flags: dict[str, Plateau]) -> Table:
    header = ["run", "recipe", "Laplacian heads", "seed", "steps", "plateau", "final metrics"]
    rows = []
    for r in runs:
        final = {k: v for k, v in r["final"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        steps = _steps(r)
        flag = flags[r["dir"]]
        rows.append(
            [
                Cell(r["name"]),
                Cell(r["recipe"]),
                Cell(r["label"]),
                Cell(str(r["seed"]), r["seed"]),
                Cell(steps, int(steps) if steps.isdigit() else None),
                Cell(flag.describe(), flag.rel_change),
                Cell(", ".join(f"{k}={_num(v)}" for k, v in final.items()), final),
            ]
        )
    return Table(header, rows)


def _figure(path: Path, out: Path, caption: str) -> Figure:
    return Figure(path.relative_to(out).as_posix(), caption, caption)


def _recipe_section(
    recipe: str, groups: dict, flags: dict[str, Plateau], out: Path, plateau_window: float, plateau_tol: float
) -> Section:
    """The section of one recipe: its table, the note on the columns, its figures (drawn here) and,
    for learned head mixing, the suggested fixed selections."""
    figs = out / "figures"
    sec = Section(
        recipe,
        tables=[_setting_table(recipe, groups, flags)],
        notes=[
            "Geometry columns: the last transformer block (NC1 also at the classifier input), measured "
            "on held-out data (`lapheads analyze`); mean ± std over seeds. Plateaued: runs whose "
            f"validation metric changed by less than {100 * plateau_tol:g}% over the last "
            f"{100 * plateau_window:g}% of training (unknown: fewer than 3 eval points)."
        ],
    )
    makers = [
        ("curves", _fig_curves, "training loss per step"),
        ("val_curves", _fig_val_curves, "validation metric per eval step (mean ± std over seeds)"),
        ("metric", _fig_metric, "final metric per Laplacian-head setting (dots: seeds)"),
        ("layers", _fig_layers, "token geometry per layer"),
        ("spectra", _fig_spectra, "per-sequence spectrum of the last block"),
    ]
    for name, fn, caption in makers:
        p = fn(groups, figs / f"{recipe}_{name}.png", recipe)
        if p is not None:
            sec.figures.append(_figure(p, out, f"{recipe}: {caption}"))
    if get_recipe(recipe).kind == "vit":  # vision runs; a language model has no patch tokens
        p = _fig_pca(groups, figs / f"{recipe}_pca.png", recipe)
        if p is not None:
            sec.figures.append(_figure(p, out, f"{recipe}: PCA maps of patch tokens (top 3 components as RGB)"))
    mixing = learned_mixing(groups, figs / f"{recipe}_mixing.png")  # learnable head mixing (issue 13)
    if mixing is not None:
        sec.figures.append(_figure(mixing[0], out, f"{recipe}: learned head mixing, Laplacian-ness per layer and head"))
        sec.items += mixing[1]
    return sec


def _verdict(c: dict[str, Any]) -> Verdict:
    return Verdict(c["claim"], c["key"], c["how"], c["comparisons"], c["convergence"], c["text"])


_CLAIMS_HOW = (
    "Each setting against k=0: the difference of the means, its 95% confidence interval and "
    "Welch's t-test over seeds. Observed / opposite only at p < 0.05; otherwise not resolved, "
    "with the seeds per setting a t-test would need to detect a difference of the observed "
    "size (power 0.8, two-sided 0.05). One seed per setting: a single run, not tested."
)
_GRID_CLAIMS_HOW = (
    "The verdicts above pool every grid point of a setting, so the differences between grid "
    "points (width, training length, data size) enter the spread. The same comparisons inside "
    "each grid point, between runs that differ only in k and seed:"
)


def run_figures(run_dir: Path, out_dir: Path) -> list[tuple[Path, str]]:
    """The figures of one run's own report, drawn into ``out_dir``, as ``(file, "report/NAME")``:
    what ``lapheads train`` hands to the run's trackers (:func:`lapheads.engine.trackers.add_final_files`).
    A directory without ``config.yaml`` has none."""
    if not (Path(run_dir) / "config.yaml").is_file():
        return []
    report = make_report([run_dir], out_dir, title=f"lapheads run {Path(run_dir).name}")
    return [(Path(out_dir) / fig.path, f"report/{Path(fig.path).name}") for fig in report.figures()]


def make_report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    title: str = "lapheads report",
    intro: str = "",
    plateau_window: float = 0.2,
    plateau_tol: float = 0.01,
) -> Report:
    """Collect the runs, compute every statistic, draw the figures into ``out_dir/figures`` and
    return the :class:`Report` (nothing else is written).

    Args:
        run_dirs: run directories (finished or not: unfinished ones are named and left out of the
            final metrics).
        out_dir: the report directory; figure paths in the model are relative to it.
        title: the report's heading.
        intro: paragraphs (separated by blank lines) under the heading.
        plateau_window: fraction of training at the end over which a run's plateau flag measures
            the change of its validation metric.
        plateau_tol: largest relative change over that window that counts as a plateau.

    Returns:
        The report model, ``summary`` included.
    """
    if not run_dirs:
        raise ConfigError("no run directories given to the report")
    if not 0.0 < plateau_window <= 1.0:
        raise ConfigError(f"plateau window {plateau_window} must be in (0, 1]")
    if not (plateau_tol >= 0.0 and math.isfinite(plateau_tol)):
        raise ConfigError(f"plateau tolerance {plateau_tol} must be a finite number >= 0")
    runs = [collect_run(Path(d)) for d in run_dirs]
    out = Path(out_dir)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs)
    flags = {r["dir"]: run_plateau(r, plateau_window, plateau_tol) for r in runs}
    paragraphs = [f"Generated {time.strftime('%Y-%m-%d %H:%M')} from {len(runs)} runs."]
    paragraphs += [p.strip() for p in re.split(r"\n\s*\n", intro) if p.strip()]
    unfinished = [r["name"] for r in runs if not r["finished"]]
    if unfinished:
        paragraphs.append(f"Unfinished runs (left out of the final metrics): {', '.join(unfinished)}.")
    sections: list[Section] = []
    grid = {recipe: (table, made) for recipe, table, made in grid_sections(runs, figs)}  # scaling, k-ablation
    for recipe, groups in summary.items():
        sections.append(_recipe_section(recipe, groups, flags, out, plateau_window, plateau_tol))
        table, grid_figs = grid.get(recipe, (None, []))
        if table is not None:  # the grid table and figures under their own heading
            sections.append(Section(table[0], level=3, tables=[table[1]]))
        sections[-1].figures += [_figure(p, out, caption) for p, caption in grid_figs]
    cl = claims(summary, flags)
    if cl:
        sections.append(
            Section(
                "The paper's claims, checked on these runs",
                paragraphs=[_CLAIMS_HOW],
                verdicts=[_verdict(c) for c in cl],
            )
        )
    gcl = grid_claims(runs, flags)
    if gcl:
        sections.append(
            Section(
                "Within each grid point", level=3, paragraphs=[_GRID_CLAIMS_HOW], verdicts=[_verdict(c) for c in gcl]
            )
        )
    sections.append(Section("Runs", tables=[_runs_table(runs, flags)]))
    return Report(title, paragraphs, sections, _summary_json(summary, flags, cl, gcl))


# ----------------------------------------------------------------------------------- rendering
def _md_escape(text: Any, chars: str = "|") -> str:
    """Text for inside a Markdown construct: ``chars`` backslash-escaped, line breaks made spaces."""
    text = " ".join(str(text).splitlines())
    return "".join("\\" + ch if ch in chars else ch for ch in text)


def _environment():
    """The templates of ``lapheads/templates``; autoescaping for ``*.html.j2`` only."""
    import jinja2  # lazy: only rendering needs it

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("lapheads", "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default_for_string=False, default=False),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["md_cell"] = _md_escape  # a table cell: "|" would end it
    env.filters["md_alt"] = lambda s: _md_escape(s, "[]")  # image alt text: "]" would end it
    return env


def render_markdown(report: Report) -> str:
    """``report.md``: figures linked by their paths (relative to the report directory)."""
    return _environment().get_template("report.md.j2").render(report=report)


def render_html(report: Report, out_dir: str | Path) -> str:
    """``report.html``, self-contained: every figure (read from ``out_dir``) embedded as a data URI.

    Each ``<img>`` also names its file in ``data-file``; a script in the page sets
    ``data-images-total`` / ``data-images-loaded`` on ``<body>`` once the page has loaded, so a
    headless browser can check that every figure decoded.
    """
    out = Path(out_dir)

    def data_uri(rel: str) -> str:
        return "data:image/png;base64," + base64.b64encode((out / rel).read_bytes()).decode()

    return _environment().get_template("report.html.j2").render(report=report, data_uri=data_uri)


def build_report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    title: str = "lapheads report",
    intro: str = "",
    plateau_window: float = 0.2,
    plateau_tol: float = 0.01,
) -> dict[str, Path]:
    """Write ``report.md``, ``report.html``, ``summary.json`` and ``figures/`` comparing ``run_dirs``.

    Args: as :func:`make_report`.

    Returns:
        ``{"md": path, "html": path, "summary": path}``.
    """
    report = make_report(run_dirs, out_dir, title, intro, plateau_window, plateau_tol)
    out = Path(out_dir)
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    (out / "report.html").write_text(render_html(report, out), encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(report.summary, indent=1, default=str, allow_nan=False))
    return {"md": out / "report.md", "html": out / "report.html", "summary": out / "summary.json"}


def _steps(run: dict) -> str:
    steps = [r["step"] for r in run["train"] + run["val"] if isinstance(r.get("step"), int)]
    return str(max(steps)) if steps else "-"


def _json_safe(x: Any) -> Any:
    """NaN / inf (no data, no spread) become None: summary.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _summary_json(summary: dict, flags: dict[str, Plateau], cl: list[dict], gcl: Sequence[dict] = ()) -> dict:
    """recipe -> setting -> {key: [mean, std, n], "runs": [names], "plateau": {run: {...}},
    "comparisons": {key: {claim, verdict, diff, ci_low, ci_high, t, df, p, seeds ...}} (vs k=0),
    and for grid runs "comparisons_by_grid_point": {point: {key: {...}}} (:func:`grid_claims`)}."""
    out: dict[str, dict[str, Any]] = {}
    for rec, groups in summary.items():
        out[rec] = {}
        for lb, g in groups.items():
            d = {k: _json_safe(v) for k, v in g.items() if k != "runs"}
            d["runs"] = [r["name"] for r in g["runs"]]
            d["plateau"] = {
                r["name"]: {
                    "status": flags[r["dir"]].status,
                    "rel_change": _json_safe(flags[r["dir"]].rel_change),
                    "eval_points": flags[r["dir"]].points,
                    "window_start": flags[r["dir"]].window_start,
                }
                for r in g["runs"]
            }
            d["comparisons"] = {
                c["key"]: {
                    "claim": c["claim"],
                    "want_lower": c["want_lower"],
                    "convergence": c["convergence"],
                    **comp.to_dict(),
                }
                for c in cl
                if c["recipe"] == rec
                for comp in c["comparisons"]
                if comp.other == lb
            }
            for c in gcl:
                for comp in c["comparisons"]:
                    if c["recipe"] == rec and comp.other == lb:
                        d.setdefault("comparisons_by_grid_point", {}).setdefault(c["point"], {})[c["key"]] = {
                            "claim": c["claim"],
                            "want_lower": c["want_lower"],
                            "convergence": c["convergence"],
                            **comp.to_dict(),
                        }
            out[rec][lb] = d
    return out


# ----------------------------------------------------------------------------------- learnable mixing
def learned_mixing(groups: dict, path: Path) -> Optional[tuple[Path, list[str]]]:
    """Heatmaps of the learned head mixing and a suggested fixed selection per setting.

    For every run whose ``final/metrics.json`` holds ``lap_mix`` (runs with ``laplacian_heads:
    learn...``; see :func:`lapheads.heads.mixing_table`), one heatmap, layers x heads, coloured by
    the scale-free Laplacian-ness ``-atan(a / b) / 45 deg`` (0 = standard ``P``, 1 = Laplacian
    ``I - P``; :func:`lapheads.heads.laplacianness`), computed from ``a`` and ``b``. Per setting,
    the suggested fixed selection: heads whose Laplacian-ness, averaged over seeds, lies nearer
    the Laplacian operator (:func:`lapheads.heads.suggest_selection`).

    Returns:
        ``(figure path, lines of text)``, or None when no run learned its mixing.
    """
    panels = [
        (label, r)
        for label, g in groups.items()
        for r in g["runs"]
        if isinstance(r.get("final", {}).get("lap_mix"), list) and r["final"]["lap_mix"]
    ]
    if not panels:
        return None
    plt = _plt()
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
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
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


# ------------------------------------------------------------------------------ grid report
# (the scaling picture of a sweep over config axes: lapheads.sweep --grid / --point)
#: geometry measures plotted against each axis: (section, key, label), last transformer block
GRID_MEASURES = [
    ("anova", "frac_within_sequence", "within-sequence fraction"),
    ("anova", "frac_between_class", "between-class fraction"),
    ("spectra", "k_mean", "k99"),
    ("nc_tokens", "cdnv", "CDNV (tokens)"),
    ("cosine", "cosine_mean", "cosine"),
]
# keys that never define a grid axis: the k (and attention variant) and seed axes, and what does not change the math
_NOT_AXES = {"model.laplacian_heads", "model.attention", "train.seed"} | (RESUME_MUTABLE - {"train.max_steps"})


def grid_axes(configs: Sequence[dict]) -> list[str]:
    """Config keys whose values differ between runs (of one recipe): the grid axes of a sweep."""
    flats = [flatten_config(c) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if k not in _NOT_AXES and len({repr(f.get(k)) for f in flats}) > 1]


def _k_position(label: str, heads_total: Optional[int]) -> Optional[float]:
    """``k=3`` -> 3, ``all`` -> H (when known); None for per-layer settings."""
    if label.startswith("k=") and label[2:].isdigit():
        return float(label[2:])
    if label == "all" and heads_total:
        return float(heads_total)
    return None


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _panel_value(r: dict, section: str, k: str) -> Optional[float]:
    """A run's value of one grid panel: its final metric ``k`` (section "metric") or a geometry measure."""
    if section == "metric":
        v = r["final"].get(k)
        return float(v) if isinstance(v, (int, float)) else None
    geo = r["geometry"]
    return _geo_value(geo, _last_block(geo) if geo else None, section, k)


def grid_sections(
    runs: Sequence[dict], figs: Path
) -> list[tuple[str, Optional[tuple[str, Table]], list[tuple[Path, str]]]]:
    """Scaling figures of grid runs: metric and geometry against each grid axis, one line per k.

    ``runs`` are :func:`lapheads.report.collect_run` records. For every recipe whose runs differ in
    config values (other than k, seed and cadence keys), one figure per axis plots the recipe's
    main metric and each of :data:`GRID_MEASURES` (last block) against the axis values, mean ± std
    over seeds, one line per k (and per value of the other axes); with at least two k settings a
    further figure is the k-ablation: the same panels against k = 0..H (``all`` = H when
    ``model.num_heads`` is set).

    Returns:
        Per recipe with grid figures or a table: ``(recipe, (title, table) or None, [(figure,
        caption)])``; the table (only when there are grid axes) has one row per (grid point, k).
    """
    out: list[tuple[str, Optional[tuple[str, Table]], list[tuple[Path, str]]]] = []
    by_recipe: dict[str, list[dict]] = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r)
    for recipe, rs in by_recipe.items():
        if not METRICS.get(recipe):
            continue
        configs = [RunDir(r["dir"]).read_config() for r in rs]
        axes = grid_axes(configs)
        labels = sorted({r["label"] for r in rs})
        if not axes and len(labels) < 2:
            continue
        key, metric_name, _ = METRICS[recipe][0]
        flats = [flatten_config(c) for c in configs]
        panels = [("metric", key, metric_name)] + GRID_MEASURES
        table = None
        if axes:
            table = (
                f"{recipe}: grid (mean ± std over seeds; geometry of the last block)",
                Table(
                    [*axes, "Laplacian heads", "runs", metric_name] + [p[2] for p in GRID_MEASURES],
                    _grid_rows(rs, flats, axes, panels),
                ),
            )
        nh = {f.get("model.num_heads") for f in flats}
        heads_total = next(iter(nh)) if len(nh) == 1 and isinstance(next(iter(nh)), int) else None
        # x axes: every grid axis, then k (the ablation)
        xaxes: list[tuple[str, Any]] = [(a, (lambda i, a=a, flats=flats: flats[i].get(a))) for a in axes]
        if len(labels) >= 2:
            xaxes.append(("Laplacian heads k", lambda i, rs=rs, n=heads_total: _k_position(rs[i]["label"], n)))
        made: list[tuple[Path, str]] = []
        for name, xof in xaxes:
            fig = _grid_figure(
                rs,
                flats,
                axes,
                panels,
                name,
                xof,
                figs / f"{recipe}_grid_{re.sub(r'[^A-Za-z0-9._+-]+', '_', name)}.png",
            )
            if fig is not None:
                what = "k-ablation: " if name == "Laplacian heads k" else "scaling: "
                made.append(
                    (
                        fig,
                        f"{recipe}: {what}{metric_name} and geometry (last block) against {name}, "
                        "mean ± std over seeds",
                    )
                )
        if table is not None or made:
            out.append((recipe, table, made))
    return out


def grid_report(
    runs: Sequence[dict], figs: Path
) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[tuple[Path, str]]]:
    """:func:`grid_sections` flattened over recipes, tables as text.

    Returns:
        Tables ``(title, header, rows of cell texts)`` and ``(figure, caption)`` pairs.
    """
    parts = grid_sections(runs, figs)
    tables = [
        (title, t.header, [[c.text for c in row] for row in t.rows])
        for _, table, _ in parts
        if table is not None
        for title, t in [table]
    ]
    return tables, [f for _, _, made in parts for f in made]


def _grid_rows(rs: list[dict], flats: list[dict], axes: list[str], panels: list) -> list[list[Cell]]:
    """One table row per (grid point, k): the axis values, k, runs, then mean ± std of each panel."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rs):
        groups.setdefault((tuple(repr(flats[i].get(a)) for a in axes), r["label"]), []).append(i)

    def order(kv: tuple) -> tuple:
        (_, label), idx = kv
        vals = [flats[idx[0]].get(a) for a in axes]
        k = _k_position(label, 10**9)
        return (
            tuple((0, v, "") if _numeric([v]) else (1, 0, str(v)) for v in vals),
            k if k is not None else float("inf"),
            label,
        )

    rows: list[list[Cell]] = []
    for (_point, label), idx in sorted(groups.items(), key=order):
        cells = [flats[idx[0]].get(a) for a in axes]
        stats = [_mean_std([_panel_value(rs[i], s, k) for i in idx]) for s, k, _ in panels]
        rows.append(
            [*(Cell(str(c), c) for c in cells), Cell(label), Cell(str(len(idx)), len(idx))]
            + [Cell(f"{m:.4g} ± {sd:.2g}" if n > 1 else (f"{m:.4g}" if n else "-"), (m, sd, n)) for m, sd, n in stats]
        )
    return rows


def _grid_figure(
    rs: list[dict], flats: list[dict], axes: list[str], panels: list, name: str, xof: Any, path: Path
) -> Optional[Path]:
    """Every panel against the x axis ``name`` (values ``xof(run index)``), one line per k and other-axis
    values, mean ± std over seeds; None when the axis has fewer than two values or no panel has data."""
    lines: dict[str, dict[Any, list[int]]] = {}
    for i, r in enumerate(rs):
        x = xof(i)
        if x is None:
            continue
        others = [f"{a.rsplit('.', 1)[-1]}={flats[i].get(a)}" for a in axes if a != name]
        line = ", ".join(([r["label"]] if name != "Laplacian heads k" else []) + others) or "all runs"
        lines.setdefault(line, {}).setdefault(repr(x) if not _numeric([x]) else x, []).append(i)
    xs_all = [x for ln in lines.values() for x in ln]
    if len(set(map(repr, xs_all))) < 2:
        return None
    numeric = _numeric(xs_all)
    cats = sorted(set(xs_all), key=str) if not numeric else []
    shown = [p for p in panels if any(_panel_value(r, p[0], p[1]) is not None for r in rs)]
    if not shown:
        return None
    plt = _plt()
    fig, axs = plt.subplots(1, len(shown), figsize=(3.4 * len(shown), 3.2), squeeze=False)
    for ax, (section, k, plabel) in zip(axs[0], shown):
        for line, pts in sorted(lines.items()):
            xs = sorted(pts, key=lambda v: v if numeric else str(v))
            stats = [_mean_std([_panel_value(rs[i], section, k) for i in pts[x]]) for x in xs]
            keep = [(x, m, sd) for x, (m, sd, n) in zip(xs, stats) if n]
            if not keep:
                continue
            px = [x if numeric else cats.index(x) for x, _, _ in keep]
            ax.errorbar(px, [m for _, m, _ in keep], yerr=[sd for _, _, sd in keep], marker="o", capsize=3, label=line)
        if numeric and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels([str(c).strip("'") for c in cats], rotation=30, fontsize=7)
        ax.set_xlabel(name)
        ax.set_title(plabel, fontsize=9)
    axs[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
