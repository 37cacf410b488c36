"""Building the report: collect the runs, compute every statistic, draw the figures and fill the
:class:`~lapheads.report.model.Report` model (:func:`make_report`); :func:`build_report` also
renders and writes it."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError
from ..recipes import get_recipe
from ..stats import MIN_SEEDS, Plateau
from .claims import claims, grid_claims
from .collect import GEOMETRY, collect_run, fmt, metrics_of, num, run_at_chance, run_plateau, summarise
from .figures import (
    curve_note,
    fig_curves,
    fig_layers,
    fig_metric,
    fig_pca,
    fig_spectra,
    fig_val_curves,
    learned_mixing,
)
from .grid import grid_sections
from .model import Cell, Figure, Report, Section, Table, Verdict
from .render import render_html, render_markdown


def _plateaued(runs: list[dict], flags: dict[str, Plateau]) -> Cell:
    st = [flags[r["dir"]].status for r in runs]
    text = f"{st.count('yes')}/{len(st)}"
    return Cell(text + (f" ({st.count('unknown')} unknown)" if "unknown" in st else ""), (st.count("yes"), len(st)))


def _setting_table(recipe: str, groups: dict, flags: dict[str, Plateau]) -> Table:
    """One row per Laplacian-head setting: runs, plateaued, then the metric and geometry columns with data."""
    cols = [(m.key, m.label) for m in metrics_of(recipe)] + [(k, n) for k, *_, n in GEOMETRY]
    cols = [(k, n) for k, n in cols if any(g[k][2] for g in groups.values())]
    header = ["Laplacian heads", "runs", "plateaued"] + [n for _, n in cols]
    rows = [
        [Cell(label), Cell(str(len(g["runs"])), len(g["runs"])), _plateaued(g["runs"], flags)]
        + [Cell(fmt(*g[k]), g[k]) for k, _ in cols]
        for label, g in groups.items()
    ]
    return Table(header, rows)


def _steps(run: dict) -> str:
    steps = [r["step"] for r in run["train"] + run["val"] if isinstance(r.get("step"), int)]
    return str(max(steps)) if steps else "-"


def _runs_table(runs: list[dict], flags: dict[str, Plateau]) -> Table:
    header = ["run", "recipe", "Laplacian heads", "seed", "steps", "plateau", "at chance", "final metrics"]
    rows = []
    for r in runs:
        final = {k: v for k, v in r["final"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        steps, flag = _steps(r), flags[r["dir"]]
        chance = "-" if not r["chance"] else (f"yes ({r['at_chance']})" if r["at_chance"] else "no")
        rows.append(
            [
                Cell(r["name"]),
                Cell(r["recipe"]),
                Cell(r["label"]),
                Cell(str(r["seed"]), r["seed"]),
                Cell(steps, int(steps) if steps.isdigit() else None),
                Cell(flag.describe(), flag.rel_change),
                Cell(chance, r["at_chance"]),
                Cell(", ".join(f"{k}={num(v)}" for k, v in final.items()), final),
            ]
        )
    return Table(header, rows)


def _figure(path: Path, out: Path, caption: str) -> Figure:
    return Figure(path.relative_to(out).as_posix(), caption, caption)


def _span(values: Sequence[int]) -> str:
    """``"6"`` or ``"4 to 6"``."""
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo} to {hi}"


def what_was_run(groups: dict, flags: dict[str, Plateau]) -> str:
    """One paragraph, from the runs alone: settings, seeds, steps, eval points, plateau and chance
    counts, and whether the seeds allow a verdict."""
    runs = [r for g in groups.values() for r in g["runs"]]
    settings = "; ".join(
        f"{label}: {len(g['runs'])} run(s), seed(s) {', '.join(str(r['seed']) for r in g['runs'])}"
        for label, g in groups.items()
    )
    parts = [f"What was run: {settings}."]
    steps = [int(_steps(r)) for r in runs if _steps(r).isdigit()]
    if steps:
        parts.append(f"Optimizer steps per run: {_span(steps)}.")
    status = [flags[r["dir"]] for r in runs]
    parts.append(f"Validation points per run: {_span([f.points for f in status])}.")
    yes, flat = sum(f.status == "yes" for f in status), sum(f.flat for f in status)
    unknown = sum(f.status == "unknown" for f in status)
    plateau = f"Plateaued: {yes} of {len(runs)} runs"
    if flat:
        plateau += f"; {flat} never moved off their first validation value"
    if unknown:
        plateau += f"; {unknown} unknown (fewer than 3 validation points)"
    parts.append(plateau + ".")
    if any(r["chance"] for r in runs):
        chance = [r["name"] for r in runs if r["at_chance"]]
        parts.append(
            f"At chance (no better than a guess): {len(chance)} of {len(runs)} runs"
            + (f" ({', '.join(chance)})." if chance else ".")
        )
    fewest = min(len(g["runs"]) for g in groups.values())
    if len(groups) > 1 and fewest < MIN_SEEDS:
        parts.append(
            f"With {fewest} seed(s) in a setting (at least {MIN_SEEDS} are needed) the comparisons below "
            "show their statistics but give no observed / opposite verdict."
        )
    return " ".join(parts)


def _recipe_section(
    recipe: str, groups: dict, flags: dict[str, Plateau], out: Path, plateau_window: float, plateau_tol: float
) -> Section:
    """One recipe's section: what was run, table, notes, figures (drawn here), mixing suggestions."""
    figs = out / "figures"
    sec = Section(
        recipe,
        paragraphs=[what_was_run(groups, flags)],
        tables=[_setting_table(recipe, groups, flags)],
        notes=[
            "Geometry columns: the last transformer block (NC1 also at the classifier input), measured "
            "on held-out data (`lapheads analyze`); mean ± std over seeds. Plateaued: runs whose "
            f"validation metric moved off its first value and then changed by less than "
            f"{100 * plateau_tol:g}% over the last {100 * plateau_window:g}% of training (unknown: "
            "fewer than 3 eval points)."
        ],
    )
    makers = [
        ("curves", fig_curves, "training loss per step", "loss"),
        ("val_curves", fig_val_curves, "validation metric per eval step (mean ± std over seeds)", "val"),
        ("metric", fig_metric, "final metric per Laplacian-head setting (dots: seeds)", ""),
        ("layers", fig_layers, "token geometry per layer", ""),
        ("spectra", fig_spectra, "per-sequence spectrum of the last block", ""),
    ]
    if get_recipe(recipe).kind == "vit":  # a language model has no patch tokens
        makers.append(("pca", fig_pca, "PCA maps of patch tokens (top 3 components as RGB)", ""))
    for name, fn, caption, curve in makers:
        p = fn(groups, figs / f"{recipe}_{name}.png", recipe)
        if p is not None:
            sec.figures.append(_figure(p, out, f"{recipe}: {caption}"))
        elif curve and curve_note(groups, recipe, curve):
            sec.notes.append(curve_note(groups, recipe, curve))
    mixing = learned_mixing(groups, figs / f"{recipe}_mixing.png")
    if mixing is not None:
        sec.figures.append(_figure(mixing[0], out, f"{recipe}: learned head mixing, Laplacian-ness per layer and head"))
        sec.items += mixing[1]
    return sec


def _verdict(c: dict[str, Any]) -> Verdict:
    return Verdict(c["claim"], c["key"], c["how"], c["comparisons"], c["convergence"], c["text"])


_CLAIMS_HOW = (
    "Each setting against k=0: the difference of the means, its 95% confidence interval and "
    f"Welch's t-test over seeds. Observed / opposite only at p < 0.05 with at least {MIN_SEEDS} seeds "
    "per setting and no compared run at chance; otherwise not resolved (with the seeds per setting "
    "a t-test would need to detect a difference of the observed size, power 0.8, two-sided 0.05) "
    "or no verdict, saying why. One seed per setting: a single run, not tested."
)
_GRID_CLAIMS_HOW = (
    "The verdicts above pool every grid point of a setting, so the differences between grid "
    "points (width, training length, data size) enter the spread. The same comparisons inside "
    "each grid point, between runs that differ only in k and seed:"
)


def _verdict_count(cl: Sequence[dict]) -> str:
    """How many comparisons give a verdict, and why the others do not."""
    comps = [c for entry in cl for c in entry["comparisons"]]
    kinds = {v: sum(c.verdict == v for c in comps) for v in ("too few seeds", "at chance", "single run")}
    given = len(comps) - sum(kinds.values())
    why = [f"{n} {'with ' if v == 'too few seeds' else ''}{v}" for v, n in kinds.items() if n]
    return f"Of {len(comps)} comparisons with k=0, {given} can give a verdict" + (
        f"; the others have none ({', '.join(why)})." if why else "."
    )


def run_figures(run_dir: Path, out_dir: Path) -> list[tuple[Path, str]]:
    """The figures of one run's own report, drawn into ``out_dir``, as ``(file, "report/NAME")`` (for
    the run's trackers); none for a directory without ``config.yaml``."""
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
        run_dirs: run directories (unfinished ones are named and left out of the final metrics).
        out_dir: the report directory; figure paths in the model are relative to it.
        title: the report's heading.
        intro: paragraphs (separated by blank lines) under the heading.
        plateau_window: fraction of training at the end over which the plateau flag is measured.
        plateau_tol: largest relative change over that window that counts as a plateau.
    """
    if not run_dirs:
        raise ConfigError("no run directories given to the report")
    if not 0.0 < plateau_window <= 1.0:
        raise ConfigError(f"plateau window {plateau_window} must be in (0, 1]")
    if not (plateau_tol >= 0.0 and math.isfinite(plateau_tol)):
        raise ConfigError(f"plateau tolerance {plateau_tol} must be a finite number >= 0")
    runs = [collect_run(Path(d)) for d in run_dirs]
    for r in runs:
        r["at_chance"] = run_at_chance(r)
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
        paragraphs.append(_verdict_count(cl) + " See the paper's claims below.")
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


def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path, **options: Any) -> dict[str, Path]:
    """Write ``report.md``, ``report.html``, ``summary.json`` and ``figures/`` comparing ``run_dirs``
    (``options``: ``title``, ``intro``, ``plateau_window``, ``plateau_tol`` of :func:`make_report`);
    returns ``{"md": path, "html": path, "summary": path}``."""
    report = make_report(run_dirs, out_dir, **options)
    out = Path(out_dir)
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    (out / "report.html").write_text(render_html(report, out), encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(report.summary, indent=1, default=str, allow_nan=False))
    return {"md": out / "report.md", "html": out / "report.html", "summary": out / "summary.json"}


def _json_safe(x: Any) -> Any:
    """NaN / inf (no data, no spread) become None: summary.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _summary_json(summary: dict, flags: dict[str, Plateau], cl: list[dict], gcl: Sequence[dict] = ()) -> dict:
    """recipe -> setting -> {key: [mean, std, n], "runs", "plateau", "at_chance", "comparisons" (vs k=0),
    "comparisons_by_grid_point" (grid runs)}."""

    def entry(c: dict, comp: Any) -> dict:
        return {"claim": c["claim"], "want_lower": c["want_lower"], "convergence": c["convergence"], **comp.to_dict()}

    def matching(entries: Sequence[dict], rec: str, lb: str) -> list[tuple[dict, Any]]:
        return [(c, comp) for c in entries if c["recipe"] == rec for comp in c["comparisons"] if comp.other == lb]

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
                    "never_moved": flags[r["dir"]].flat,
                }
                for r in g["runs"]
            }
            d["at_chance"] = {r["name"]: r.get("at_chance") for r in g["runs"]}
            d["comparisons"] = {c["key"]: entry(c, comp) for c, comp in matching(cl, rec, lb)}
            for c, comp in matching(gcl, rec, lb):
                by_point = d.setdefault("comparisons_by_grid_point", {}).setdefault(c["point"], {})
                by_point[c["key"]] = entry(c, comp)
            out[rec][lb] = d
    return out
