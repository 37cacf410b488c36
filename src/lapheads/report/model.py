"""The report as data, which both renderings (:mod:`lapheads.report.render`) read: sections of
tables of formatted cells that keep their raw numbers, claim verdicts, and figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..stats import Comparison


@dataclass
class Cell:
    """One table cell: the text both formats show, and ``raw``, what it was formatted from (None for
    a label, a number, ``(mean, std, n)``, ``(plateaued, runs)``, or a run's final metrics)."""

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
    """One claim of the paper tested on the runs (:func:`claims`): the number it is ``measured`` on,
    the ``comparisons`` of every setting against k=0, and the paragraph (``text``) both formats show."""

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
