"""Text corpora read one document at a time (text, JSONL, parquet, Hugging Face datasets, the embedded
``pydoc_data.topics``), and the rules that cut and split them (docs/design/data.md)."""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from ..errors import ConfigError, DataError
from .jsonl import iter_jsonl

__all__ = [
    "embedded_documents",
    "read_text_file",
    "read_jsonl",
    "read_parquet",
    "iter_documents",
    "check_inputs",
    "limit_chars",
    "split_text",
    "split_documents",
    "SPLIT_MODES",
    "is_validation_document",
    "check_val_fraction",
    "HF_PREFIX",
    "hf_source",
    "open_hf_dataset",
    "import_datasets",
    "check_hf_column",
    "read_hf_dataset",
    "hf_fingerprint",
]


def embedded_documents() -> Iterator[str]:
    """The corpus that ships with Python: ``pydoc_data.topics.topics``, one document per topic."""
    from pydoc_data.topics import topics  # lazy: a 0.8 MB module, only for the embedded corpus

    for name in sorted(topics):  # dict order is an implementation detail; sorting makes splits stable
        yield topics[name]


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return "jsonl"
    return "text"


def read_text_file(path: str | os.PathLike) -> Iterator[str]:
    """One document: the whole file, decoded as UTF-8 (a DataError when it cannot be read or is not UTF-8)."""
    p = Path(path)
    try:
        yield p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{p}: cannot be read ({e.strerror})") from e


def read_jsonl(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """One document per line: ``json.loads(line)[text_field]``; blank lines are skipped. A DataError
    names ``file:line`` for a line that is not JSON, not an object, or lacks the field."""
    p = Path(path)
    for n, obj in iter_jsonl(p):
        if text_field not in obj:
            raise DataError(
                f"{p}:{n}: no key {text_field!r}; keys found: {sorted(obj)[:20]} (choose one with --text-field)"
            )
        text = obj[text_field]
        if not isinstance(text, str):
            raise DataError(f"{p}:{n}: {text_field!r} is a {type(text).__name__}, expected a string")
        yield text


def _parquet_file(p: Path, text_field: str):
    import pyarrow.parquet as pq  # lazy: ~2.5 s to import, parquet corpora only

    try:
        pf = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for truncated or non-parquet files
        raise DataError(f"{p}: not a readable parquet file ({e})") from e
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(
            f"{p}: parquet file has no column {text_field!r}; columns found: {names} (choose one with --text-field)"
        )
    return pf


def read_parquet(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """One document per row of the ``text_field`` column, read one row group at a time; a DataError when
    the file is not parquet or has no such column (the columns found are listed)."""
    p = Path(path)
    pf = _parquet_file(p, text_field)
    for g in range(pf.num_row_groups):
        try:
            col = pf.read_row_group(g, columns=[text_field]).column(0)
        except Exception as e:
            raise DataError(f"{p}: row group {g} cannot be read ({e})") from e
        for i, text in enumerate(col.to_pylist()):
            if text is None:
                continue  # a null cell is an absent document, not an error
            if not isinstance(text, str):
                raise DataError(
                    f"{p}: column {text_field!r} holds {type(text).__name__} values "
                    f"(row group {g}, row {i}); expected strings"
                )
            yield text


def iter_documents(paths: Sequence[str | os.PathLike], text_field: str = "text") -> Iterator[str]:
    """Documents of several files in order, each read by the reader its extension selects."""
    for path in paths:
        p = Path(path)
        reader = {"parquet": read_parquet, "jsonl": read_jsonl}.get(_kind(p))
        yield from reader(p, text_field) if reader else read_text_file(p)


def check_inputs(paths: Sequence[str | os.PathLike], text_field: str = "text") -> None:
    """Open every input cheaply before any expensive work (existence, emptiness, schema, first line); a
    DataError names the file and the problem."""
    if not paths:
        raise DataError("no input files given")
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DataError(
                f"{p}: is a directory, not a text/JSONL/parquet file" if p.is_dir() else f"{p}: no such file"
            )
        if p.stat().st_size == 0:
            raise DataError(f"{p}: the file is empty")
        kind = _kind(p)
        if kind == "parquet":
            _parquet_file(p, text_field)
        elif kind == "jsonl":
            next(read_jsonl(p, text_field), None)


def limit_chars(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    """Pass documents through until ``max_chars`` characters were yielded (the last one is cut)."""
    left = max_chars
    for d in docs:
        if left <= 0:
            return
        yield d[:left]
        left -= len(d)


HF_PREFIX = "hf:"
_HF_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".txt": "text"}
_HF_BUILDERS.update(dict.fromkeys((".json", ".jsonl", ".ndjson"), "json"))


def hf_source(spec: Any) -> Optional[str]:
    """``"PATH_OR_NAME"`` of an ``"hf:PATH_OR_NAME"`` data spec, else None."""
    rest = spec[len(HF_PREFIX) :].strip() if isinstance(spec, str) and spec.startswith(HF_PREFIX) else ""
    return rest or None


def import_datasets() -> Any:
    """The ``datasets`` package; a ConfigError naming the extra when it is missing."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "an hf: data source needs the 'datasets' package; install it with pip install datasets "
            "(or pip install 'lapheads[hf]')"
        ) from None
    return datasets


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def open_hf_dataset(
    source: str, split: Optional[str] = "train", name: Optional[str] = None, streaming: bool = False, what: str = "data"
) -> Any:
    """A ``datasets`` dataset from a path or a name: a ``save_to_disk`` directory (``load_from_disk``,
    memory-mapped), a data file or glob (``.parquet``, ``.json``/``.jsonl``, ``.csv``, ``.arrow``,
    ``.txt``: ``load_dataset(<format>, data_files=...)``), else ``load_dataset(source, name)`` as
    ``datasets`` resolves it (a folder of data files, a Hub name, its cache, ``HF_HUB_OFFLINE``).
    ``split=None`` returns every split; ``streaming`` an ``IterableDataset`` (corpora larger than memory).
    A DataError is one line naming ``what``, the source and the split, with ``datasets``' reason.
    """
    datasets = import_datasets()
    p = Path(os.path.expanduser(source))
    where = f"{what}: Hugging Face dataset {source!r}" + (f" (config {name!r})" if name else "")
    try:
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict) and split is not None:
                if split not in ds:
                    raise DataError(f"{where} has the splits {', '.join(ds)}, not {split!r}")
                ds = ds[split]
            if streaming and isinstance(ds, datasets.DatasetDict):
                ds = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in ds.items()})
            elif streaming:
                ds = ds.to_iterable_dataset()
            return ds
        suffix = p.suffix.lower()
        if suffix in _HF_BUILDERS and (p.is_file() or any(c in source for c in "*?[")):
            return datasets.load_dataset(
                _HF_BUILDERS[suffix], data_files={split or "train": str(p)}, split=split, streaming=streaming
            )
        if not p.exists() and (source.startswith((".", "/", "~")) or os.sep in source.strip("/").replace("/", "", 1)):
            raise DataError(f"{where}: no such file or directory")
        return datasets.load_dataset(source, name, split=split, streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types (missing files, offline hub, bad split)
        raise DataError(f"{where}, split {split!r}, cannot be opened: {_one_line(e)}") from None


def check_hf_column(ds: Any, column: str, what: str, key: str) -> None:
    """Raise one DataError line naming ``key`` (the config key) when ``ds`` has no ``column``."""
    names = getattr(ds, "column_names", None)
    if names is None:  # a stream of unknown features: look at its first row
        first = next(iter(ds), None)
        names = list(first) if isinstance(first, dict) else []
    if column not in names:
        raise DataError(
            f"{what}: the dataset has no column {column!r} ({key}); its columns: {', '.join(names) or 'none'}"
        )


def read_hf_dataset(ds: Any, text_field: str = "text", source: str = "hf") -> Iterator[str]:
    """One document per row: the string in column ``text_field`` (empty rows and None are skipped; a value
    that is not a string is a DataError naming the row)."""
    rows = ds.select_columns([text_field]) if hasattr(ds, "select_columns") else ds
    for i, row in enumerate(rows):
        text = row[text_field]
        if text is None or text == "":
            continue
        if not isinstance(text, str):
            raise DataError(
                f"{source}: column {text_field!r} holds {type(text).__name__} values (row {i}); expected strings"
            )
        yield text


def hf_fingerprint(source: str, ds: Any, name: Optional[str], split: str) -> Any:
    """What identifies a Hugging Face corpus in a cache key: local files by path, size and mtime;
    a Hub dataset by its ``datasets`` fingerprint (a stream: by name, config and split)."""
    p = Path(os.path.expanduser(source))
    key: dict[str, Any] = {"hf": source, "name": name, "split": split}
    if p.exists():
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        key["files"] = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files[:10_000]]
    elif getattr(ds, "_fingerprint", None):
        key["fingerprint"] = ds._fingerprint
    return key


SPLIT_MODES = ("blank_lines", "chapters")  # or a positive int: characters per piece
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_NUMBER_WORDS = (
    r"one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|"
    r"sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|"
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|last"
)
_CHAPTER = re.compile(
    r"^[ \t]*(?:chapter|book|part)[ \t]+(?:\d+|[ivxlcdm]+|(?:" + _NUMBER_WORDS + r")(?:-\w+)?)\b"
    r"[^\n]{0,80}$",
    re.IGNORECASE | re.MULTILINE,
)


def check_split_mode(how: Any, name: str = "split_documents") -> Any:
    """``None``, ``"blank_lines"``, ``"chapters"`` or a positive int; anything else is a ConfigError."""
    if how is None or how in SPLIT_MODES or (isinstance(how, int) and not isinstance(how, bool) and how >= 1):
        return how
    if isinstance(how, str) and how.strip().isascii() and how.strip().isdigit() and int(how) >= 1:
        return int(how)
    raise ConfigError(f"{name}={how!r} must be one of {list(SPLIT_MODES)} or a positive number of characters")


def split_text(text: str, how: Any, where: str = "") -> list[str]:
    """Cut one document into several: ``how`` is ``"blank_lines"`` (paragraphs), ``"chapters"`` (before
    each heading such as ``Chapter 12`` on a line of its own; a DataError naming ``where`` if there is none)
    or about N characters (cut at whitespace); blank pieces are dropped."""
    how = check_split_mode(how)
    if how is None:
        return [text]
    if how == "blank_lines":
        pieces = _BLANK_LINES.split(text)
    elif how == "chapters":
        starts = [m.start() for m in _CHAPTER.finditer(text)]
        if not starts:
            raise DataError(
                f"{where or 'the text'}: no chapter heading (a line such as 'Chapter 1', 'CHAPTER IV.' "
                "or 'Book Two'); split it with blank_lines or a number of characters instead"
            )
        bounds = ([0] if starts[0] > 0 else []) + starts + [len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    else:
        pieces, pos = [], 0
        while pos < len(text):
            end = min(pos + how, len(text))
            if end < len(text):
                cut = max(text.rfind(" ", pos + how // 2, end), text.rfind("\n", pos + how // 2, end))
                end = cut + 1 if cut > pos else end
            pieces.append(text[pos:end])
            pos = end
    return [p for p in pieces if p.strip()]


def split_documents(docs: Iterable[str], how: Any, source: str = "") -> Iterator[str]:
    """Every document of ``docs`` cut by :func:`split_text` (``how=None``: passed through)."""
    how = check_split_mode(how)
    for i, d in enumerate(docs):
        yield from split_text(d, how, where=f"{source or 'corpus'} document {i}")


def check_val_fraction(val_fraction: float) -> Fraction:
    """``val_fraction`` as an exact fraction; a ConfigError unless it is in [0, 1)."""
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction!r} must be a number in [0, 1)")
    return Fraction(str(val_fraction)).limit_denominator(10**6)


def is_validation_document(i: int, val_fraction: float | Fraction) -> bool:
    """Whether input document ``i`` is validation: ``ceil((i + 1) f) > ceil(i f)`` (spread evenly; the first always is)."""
    f = val_fraction if isinstance(val_fraction, Fraction) else check_val_fraction(val_fraction)
    return math.ceil((i + 1) * f) > math.ceil(i * f)  # exact: a Fraction's ceil
