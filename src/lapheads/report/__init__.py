"""``lapheads report RUN_DIR [RUN_DIR ...]``: compare runs, grouped by their Laplacian heads.

:func:`build_report` writes ``report.md`` (figures beside it in ``figures/``), a self-contained
``report.html`` (the same Markdown converted) and ``summary.json``; what a report holds is on the
docs page "Sweeps, statistics and reports", how it is built in docs/design/geometry.md.
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
