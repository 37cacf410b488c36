"""Rendering the report model: ``report.md`` from one Jinja2 template, and ``report.html`` from that
Markdown through one Markdown-to-HTML path (the ``markdown`` library), figures embedded."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from .model import Report


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


def _converter(out: Path):
    """A ``markdown.Markdown`` with tables, no raw HTML, and images embedded from ``out``."""
    import markdown  # lazy: only the HTML rendering needs it
    from markdown.extensions import Extension
    from markdown.treeprocessors import Treeprocessor

    class EmbedImages(Treeprocessor):
        def run(self, root: Any) -> None:
            for img in root.iter("img"):
                rel = img.get("src")
                img.set("data-file", rel)
                img.set("src", "data:image/png;base64," + base64.b64encode((out / rel).read_bytes()).decode())

    class ReportHtml(Extension):
        def extendMarkdown(self, md: Any) -> None:
            md.preprocessors.deregister("html_block")  # raw HTML stays text
            md.inlinePatterns.deregister("html")
            md.treeprocessors.register(EmbedImages(md), "lapheads_embed_images", 0)

    return markdown.Markdown(extensions=["tables", ReportHtml()], output_format="html")


def render_html(report: Report, out_dir: str | Path) -> str:
    """``report.html``, self-contained: :func:`render_markdown` converted to HTML, every figure (read
    from ``out_dir``) embedded as a data URI and named in ``data-file``."""
    from markupsafe import Markup  # lazy, with jinja2

    body = _converter(Path(out_dir)).convert(render_markdown(report))
    return _environment().get_template("report.html.j2").render(title=report.title, body=Markup(body))
