"""The command-line layer: every ``lapheads <command>`` as a ``main(argv) -> int`` function.

``lapheads.cli`` imports a module of this package only when its command runs. These modules parse
arguments, call the library (``recipes``, ``runs``, ``report``, ``sweep``, ``lm``, ``vision``,
``geometry``) and print; no library module imports them.
"""

from __future__ import annotations

import argparse
from typing import Any


def repeated(p: Any, flag: str, help: str, **kwargs: Any) -> None:
    """Add a repeatable option to parser (or group) ``p``: each use appends to a list, empty by default."""
    p.add_argument(flag, action="append", default=[], help=help, **kwargs)


def opts(args: argparse.Namespace, names: str) -> dict[str, Any]:
    """``{name: args.name}`` for each of the space-separated ``names`` (keyword arguments named as the flags)."""
    return {n: getattr(args, n) for n in names.split()}
