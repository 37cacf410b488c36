"""``lapheads report RUN_DIR [RUN_DIR ...]``: compare runs, grouped by their Laplacian heads.

Writes ``report.md`` (figures beside it in ``figures/``), a self-contained ``report.html`` (the
same Markdown converted, figures embedded as data URIs) and ``summary.json``. For every recipe
present:

* what was run, from the runs themselves: settings and seeds, optimizer steps, validation points,
  how many runs plateaued and how many are at chance;
* a table with one row per Laplacian-head setting: runs, how many plateaued, the recipe's metrics
  (:attr:`lapheads.recipes.Recipe.metrics`) and the geometry of the last block (NC1 also at the
  classifier input) as mean ± std over seeds;
* figures: training loss and validation-metric curves (mean ± std over seeds; a curve with fewer
  than 3 points is left out with a sentence saying so), the main metric per setting, ANOVA
  fractions / k99 / cosine per layer, singular-value spectra, and (vision) PCA maps of images
  drawn from several classes;
* one paragraph per claim of the paper, comparing every setting with the baseline (k=0): the
  difference with its 95% confidence interval, Welch's t and p and the seeds per setting
  (:mod:`lapheads.stats`). A verdict is "observed" / "opposite" only at p < 0.05 with at least 3
  seeds per setting and no compared run at chance, otherwise "not resolved" (with the seeds such
  an effect would need) or no verdict with its reason; one seed per setting is a "single run";
* a table of the runs with a plateau flag each (the validation metric moved off its first value,
  then changed by less than ``--plateau-tol`` over the last ``--plateau-window`` fraction of
  training; a run stopped by ``train.until_plateau`` counts as plateaued once it had moved) and
  an at-chance flag (:meth:`lapheads.recipes.Recipe.chance`, :func:`lapheads.stats.at_chance`).

The package follows the report's parts: :mod:`~lapheads.report.collect` (runs, numbers, grid
points), :mod:`~lapheads.report.figures`, :mod:`~lapheads.report.claims`,
:mod:`~lapheads.report.grid` (sweeps over config axes), :mod:`~lapheads.report.model` (the data
model both formats render), :mod:`~lapheads.report.build` (:func:`make_report`,
:func:`build_report`) and :mod:`~lapheads.report.render` (Markdown, and HTML converted from it).
All wording and every number is decided in Python; the templates only lay it out.
"""

from __future__ import annotations

from .build import build_report, make_report, run_figures, what_was_run
from .claims import CLAIMS, claims, comparisons, grid_claims
from .collect import (
    GEOMETRY,
    collect_run,
    fmt,
    grid_axes,
    grid_points,
    main_metric,
    metrics_of,
    num,
    run_at_chance,
    run_plateau,
    run_value,
    summarise,
)
from .figures import curve_series, learned_mixing
from .grid import GRID_MEASURES, grid_report, grid_sections
from .model import Cell, Figure, Report, Section, Table, Verdict
from .render import render_html, render_markdown

__all__ = [
    "build_report", "make_report", "run_figures", "what_was_run", "CLAIMS", "claims", "comparisons", "grid_claims",
    "GEOMETRY", "collect_run", "curve_series", "fmt", "grid_axes", "grid_points", "main_metric", "metrics_of",
    "num", "run_at_chance", "run_plateau", "run_value", "summarise", "learned_mixing", "GRID_MEASURES",
    "grid_report", "grid_sections", "Cell", "Figure", "Report", "Section", "Table", "Verdict", "render_html",
    "render_markdown"
]  # fmt: skip
