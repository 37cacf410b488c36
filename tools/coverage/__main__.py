"""``python -m tools.coverage <timm | transformers> [--write FILE | --check FILE] [--only NAME ...]``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from .table import Row, counts, write_or_check


def _show(row: Row) -> None:
    print(
        f"[{row.seconds:5.1f}s] {row.status:9s} {row.family[:40]:40s} {row.model[:28]:28s} {row.detail[:80]}",
        file=sys.stderr,
    )


def _timm(args: argparse.Namespace) -> tuple[list[Row], str]:
    from . import timm_table

    rows = timm_table.timm_coverage(args.only)
    for r in rows:
        _show(r)
    return rows, timm_table.timm_markdown(rows)


def _transformers(args: argparse.Namespace) -> tuple[list[Row], str]:
    from . import transformers_table

    families, skipped = transformers_table.transformers_families()
    if args.only:
        families = {f: m for f, m in families.items() if set(m) & set(args.only)}
    rows = transformers_table.transformers_coverage(families, reload=not args.no_reload, progress=_show)
    return rows, transformers_table.transformers_markdown(rows, skipped)


#: library -> (function building the rows and the Markdown, help, what --only names)
LIBRARIES = {
    "timm": (_timm, "timm architecture families (timm.list_modules())", "timm families (registering modules)"),
    "transformers": (_transformers, "transformers model types, one representative per attention family", "model types"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.coverage", description="Regenerate or check the coverage tables of docs/."
    )
    sub = parser.add_subparsers(dest="library", required=True)
    for name, (_, help_text, only) in LIBRARIES.items():
        p = sub.add_parser(name, help=help_text)
        what = p.add_mutually_exclusive_group()
        what.add_argument("--write", metavar="FILE", help="write the Markdown table here (default: stdout)")
        what.add_argument("--check", metavar="FILE", help="compare with FILE; print the diff and exit 1 if it differs")
        p.add_argument("--only", nargs="+", metavar="NAME", help=f"only these {only}")
        p.add_argument("--no-reload", action="store_true", help="transformers: skip the save + reload check")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows, text = LIBRARIES[args.library][0](args)
    families, _ = counts(rows)
    print(f"{time.perf_counter() - start:.1f}s: " + ", ".join(f"{s} {n}" for s, n in families.items()), file=sys.stderr)
    return write_or_check(text, args.write, args.check)


if __name__ == "__main__":
    sys.exit(main())
