"""One JSONL reader for corpora, chat data and task files."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Iterator

from ..errors import DataError


def iter_jsonl(path: str | os.PathLike, what: str = "JSONL file") -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a ``.jsonl`` (or ``.jsonl.gz``) file; a DataError
    for a missing, unreadable or non-UTF-8 file or a line that is not a JSON object names the file as ``what``
    ("task file", "chat JSONL file", ...)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: is a directory, not a {what}" if p.is_dir() else f"{p}: {what} not found")
    opener = gzip.open if p.name.endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno}); expected one JSON object per line"
                    ) from None
                if not isinstance(obj, dict):
                    raise DataError(f"{p}:{n}: expected a JSON object, got {type(obj).__name__}")
                yield n, obj
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e.reason})") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{p}: cannot read {what} ({e})") from None
