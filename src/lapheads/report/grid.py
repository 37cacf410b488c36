"""The scaling picture of a sweep over config axes: per recipe, a table with one row per (grid point,
k), and figures of the main metric and the last block's geometry against each axis and against k."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

from ..engine.run import RunDir, flatten_config
from .collect import axis_order, by_recipe, grid_axes, last_block_value, main_metric, mean_std, numeric
from .figures import pyplot, save
from .model import Cell, Table

#: geometry measures plotted against each axis: (section, key, label), last transformer block
GRID_MEASURES = [
    ("anova", "frac_within_sequence", "within-sequence fraction"),
    ("anova", "frac_between_class", "between-class fraction"),
    ("spectra", "k_mean", "k99"),
    ("nc_tokens", "cdnv", "CDNV (tokens)"),
    ("cosine", "cosine_mean", "cosine"),
]


def _k_position(label: str, heads_total: Optional[int]) -> Optional[float]:
    """``k=3`` -> 3, ``all`` -> H (when known); None for per-layer settings."""
    if label.startswith("k=") and label[2:].isdigit():
        return float(label[2:])
    if label == "all" and heads_total:
        return float(heads_total)
    return None


def _panel_value(r: dict, section: str, k: str) -> Optional[float]:
    """A run's value of one grid panel: its final metric ``k`` (section "metric") or a geometry measure."""
    if section == "metric":
        v = r["final"].get(k)
        return float(v) if isinstance(v, (int, float)) else None
    return last_block_value(r["geometry"], section, k)


def grid_sections(
    runs: Sequence[dict], figs: Path
) -> list[tuple[str, Optional[tuple[str, Table]], list[tuple[Path, str]]]]:
    """Scaling figures of grid runs (:func:`~lapheads.report.collect.collect_run` records): per axis,
    the main metric and :data:`GRID_MEASURES` (last block) against its values, mean ± std over seeds,
    one line per k and other-axis values; with two or more k settings, the k-ablation against
    k = 0..H (``all`` = H when ``model.num_heads`` is set).

    Returns:
        Per recipe with grid figures or a table: ``(recipe, (title, table) or None, [(figure,
        caption)])``; the table (only with grid axes) has one row per (grid point, k).
    """
    out: list[tuple[str, Optional[tuple[str, Table]], list[tuple[Path, str]]]] = []
    for recipe, rs in by_recipe(runs).items():
        m = main_metric(recipe)
        if m is None:
            continue
        configs = [RunDir(r["dir"]).read_config() for r in rs]
        axes = grid_axes(configs)
        labels = sorted({r["label"] for r in rs})
        if not axes and len(labels) < 2:
            continue
        flats = [flatten_config(c) for c in configs]
        panels = [("metric", m.key, m.label)] + GRID_MEASURES
        table = None
        if axes:
            header = [*axes, "Laplacian heads", "runs", m.label] + [p[2] for p in GRID_MEASURES]
            title = f"{recipe}: grid (mean ± std over seeds; geometry of the last block)"
            table = (title, Table(header, _grid_rows(rs, flats, axes, panels)))
        nh = {f.get("model.num_heads") for f in flats}
        heads_total = next(iter(nh)) if len(nh) == 1 and isinstance(next(iter(nh)), int) else None
        # x axes: every grid axis, then k (the ablation)
        xaxes: list[tuple[str, Any]] = [(a, (lambda i, a=a, flats=flats: flats[i].get(a))) for a in axes]
        if len(labels) >= 2:
            xaxes.append(("Laplacian heads k", lambda i, rs=rs, n=heads_total: _k_position(rs[i]["label"], n)))
        made: list[tuple[Path, str]] = []
        for name, xof in xaxes:
            path = figs / f"{recipe}_grid_{re.sub(r'[^A-Za-z0-9._+-]+', '_', name)}.png"
            fig = _grid_figure(rs, flats, axes, panels, name, xof, path)
            what = "k-ablation" if name == "Laplacian heads k" else "scaling"
            about = f"{m.label} and geometry (last block) against {name}, mean ± std over seeds"
            if fig is not None:
                made.append((fig, f"{recipe}: {what}: {about}"))
        if table is not None or made:
            out.append((recipe, table, made))
    return out


def grid_report(
    runs: Sequence[dict], figs: Path
) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[tuple[Path, str]]]:
    """:func:`grid_sections` flattened over recipes: tables ``(title, header, rows of cell texts)`` and
    ``(figure, caption)`` pairs."""
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
        k = _k_position(label, 10**9)
        return (axis_order([flats[idx[0]].get(a) for a in axes]), k if k is not None else float("inf"), label)

    rows: list[list[Cell]] = []
    for (_point, label), idx in sorted(groups.items(), key=order):
        cells = [flats[idx[0]].get(a) for a in axes]
        stats = [mean_std([_panel_value(rs[i], s, k) for i in idx]) for s, k, _ in panels]
        rows.append(
            [*(Cell(str(c), c) for c in cells), Cell(label), Cell(str(len(idx)), len(idx))]
            + [Cell(f"{m:.4g} ± {sd:.2g}" if n > 1 else (f"{m:.4g}" if n else "-"), (m, sd, n)) for m, sd, n in stats]
        )
    return rows


def _grid_figure(
    rs: list[dict], flats: list[dict], axes: list[str], panels: list, name: str, xof: Any, path: Path
) -> Optional[Path]:
    """Every panel against the x axis ``name`` (``xof(run index)``); None with < 2 x values or no data."""
    lines: dict[str, dict[Any, list[int]]] = {}
    for i, r in enumerate(rs):
        x = xof(i)
        if x is None:
            continue
        others = [f"{a.rsplit('.', 1)[-1]}={flats[i].get(a)}" for a in axes if a != name]
        line = ", ".join(([r["label"]] if name != "Laplacian heads k" else []) + others) or "all runs"
        lines.setdefault(line, {}).setdefault(repr(x) if not numeric([x]) else x, []).append(i)
    xs_all = [x for ln in lines.values() for x in ln]
    if len(set(map(repr, xs_all))) < 2:
        return None
    is_num = numeric(xs_all)
    cats = sorted(set(xs_all), key=str) if not is_num else []
    shown = [p for p in panels if any(_panel_value(r, p[0], p[1]) is not None for r in rs)]
    if not shown:
        return None
    plt = pyplot()
    fig, axs = plt.subplots(1, len(shown), figsize=(3.4 * len(shown), 3.2), squeeze=False)
    for ax, (section, k, plabel) in zip(axs[0], shown):
        for line, pts in sorted(lines.items()):
            xs = sorted(pts, key=lambda v: v if is_num else str(v))
            stats = [mean_std([_panel_value(rs[i], section, k) for i in pts[x]]) for x in xs]
            keep = [(x, m, sd) for x, (m, sd, n) in zip(xs, stats) if n]
            if not keep:
                continue
            px = [x if is_num else cats.index(x) for x, _, _ in keep]
            ax.errorbar(px, [m for _, m, _ in keep], yerr=[sd for _, _, sd in keep], marker="o", capsize=3, label=line)
        if is_num and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
            ax.set_xscale("log")
        if not is_num:
            ax.set_xticks(range(len(cats)), [str(c).strip("'") for c in cats], rotation=30, fontsize=7)
        ax.set_xlabel(name)
        ax.set_title(plabel, fontsize=9)
    axs[0][0].legend(fontsize=7)
    return save(fig, path, dpi=100)
