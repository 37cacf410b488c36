"""ARC, MMLU, GSM8K and HumanEval in the chat format, as lm-evaluation-harness tasks.

The YAML files of :data:`TASKS_DIR` define ``lapheads_chat_arc_easy``, ``lapheads_chat_arc_challenge``,
``lapheads_chat_mmlu``, ``lapheads_chat_gsm8k`` and ``lapheads_chat_humaneval`` (tag ``lapheads_chat``)
with the functions below (``!function lapheads.lm.tasks.<name>``). ``lapheads eval lm --tasks`` runs
them on local JSONL files, ``lapheads lm-eval --tasks lapheads_chat_mmlu`` on the Hub data sets.
Design notes: ``docs/design/lm.md``.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from ...data.benchmarks import LETTERS, BenchmarkItem, canonical_name, normalize_number, parse_row
from ...sandbox import build_humaneval_program, require_sandbox, run_many

__all__ = [
    "TASKS_DIR",
    "CHAT_TASKS",
    "PASS_KS",
    "SandboxOptions",
    "sandbox_options",
    "chat_prompt",
    "render_multiple_choice",
    "extract_answer",
    "extract_code",
    "humaneval_program",
    "pass_at_k",
    "chat_task_config",
]

#: The directory of the task YAML files (lm-eval's ``include_path``).
TASKS_DIR = Path(__file__).resolve().parent

#: ``lapheads eval lm --tasks`` name -> lm-eval task name.
CHAT_TASKS: dict[str, str] = {
    "arc_easy": "lapheads_chat_arc_easy",
    "arc_challenge": "lapheads_chat_arc_challenge",
    "mmlu": "lapheads_chat_mmlu",
    "gsm8k": "lapheads_chat_gsm8k",
    "humaneval": "lapheads_chat_humaneval",
}

#: The k of every pass@k the HumanEval task can report (those above the number of samples are left out).
PASS_KS = (1, 10, 100)


# ------------------------------------------------------------------------------------ prompts
def chat_prompt(user: str) -> str:
    """The text of a one-message chat with the assistant's turn opened (nanochat's format)."""
    return f"<|bos|><|user_start|>{user}<|user_end|><|assistant_start|>"


def _choice_item(doc: dict) -> BenchmarkItem:
    # ARC rows have answerKey, MMLU rows an answer: one set of functions serves the three tasks
    return parse_row("arc_easy" if "answerKey" in doc else "mmlu", doc)


def render_multiple_choice(item: BenchmarkItem) -> str:
    """nanochat's multiple-choice user message: the letter follows its choice, with no space."""
    assert item.choices is not None
    lines = [f"Multiple Choice question: {item.question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(item.letters, item.choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."


def choice_doc_to_text(doc: dict) -> str:
    """ARC / MMLU prompt (``doc_to_text``)."""
    return chat_prompt(render_multiple_choice(_choice_item(doc)))


def choice_doc_to_choice(doc: dict) -> list[str]:
    """The letters scored, one per choice (``doc_to_choice``)."""
    return list(LETTERS[: len(_choice_item(doc).choices or [])])


def choice_doc_to_target(doc: dict) -> int:
    """Index of the correct choice (``doc_to_target``)."""
    index = _choice_item(doc).answer_index
    assert index is not None
    return index


# --------------------------------------------------------------------------------------- GSM8K
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def extract_answer(text: str) -> Optional[str]:
    """The final numeric answer of a GSM8K-style completion, normalised (:func:`normalize_number`), or None.

    The first number after the last ``####`` when there is one, else the last number in the text.
    """
    if "####" in text:
        nums = _NUMBER.findall(text.rsplit("####", 1)[1])
        if nums:
            return normalize_number(nums[0])
    nums = _NUMBER.findall(text)
    return normalize_number(nums[-1]) if nums else None


def gsm8k_doc_to_text(doc: dict) -> str:
    """GSM8K prompt: the question as the user message (``doc_to_text``)."""
    return chat_prompt(parse_row("gsm8k", doc).question)


def gsm8k_doc_to_target(doc: dict) -> str:
    """The reference's normalised final answer (``doc_to_target``)."""
    target = parse_row("gsm8k", doc).target
    assert target is not None
    return target


def gsm8k_final_numbers(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """The ``final_number`` filter: each completion's :func:`extract_answer` (``""`` when it has none)."""
    return [[extract_answer(text) or "" for text in texts] for texts in resps]


# ----------------------------------------------------------------------------------- HumanEval
@dataclass(frozen=True)
class SandboxOptions:
    """How the HumanEval task runs programs (see :func:`lapheads.sandbox.run_code`).

    Attributes:
        timeout: wall-clock seconds per program.
        workers: programs run at once.
        allow_unsafe: run without bubblewrap where it cannot run (``--confirm-run-unsafe-code``);
            otherwise such a run is refused.
    """

    timeout: float = 5.0
    workers: int = 2
    allow_unsafe: bool = False


_options = SandboxOptions()


@contextmanager
def sandbox_options(**changes: Any) -> Iterator[SandboxOptions]:
    """Run the HumanEval task with other :class:`SandboxOptions` inside the ``with`` block (module state:
    lm-eval calls the task's functions with documents and responses only)."""
    global _options
    saved = _options
    _options = replace(saved, **changes)
    try:
        yield _options
    finally:
        _options = saved


_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The first fenced code block of a completion, or the completion itself."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def _prompt_imports(prompt: str) -> str:
    lines = []
    for line in prompt.splitlines():
        s = line.strip()
        if s.startswith(("import ", "from ")):
            lines.append(s)
        elif s and not s.startswith("#"):
            break
    return "\n".join(lines)


def humaneval_program(item: BenchmarkItem, completion: str) -> tuple[str, str]:
    """``(prefix, body)`` to run for a completion.

    A completion that defines ``def <entry_point>(`` is a whole function (chat style): it runs
    after the prompt's imports. Otherwise it continues the prompt (base style).
    """
    code = extract_code(completion)
    assert item.entry_point is not None
    if re.search(rf"^\s*def\s+{re.escape(item.entry_point)}\s*\(", code, re.MULTILINE):
        return _prompt_imports(item.question) + "\n\n", code
    return item.question, code


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al., 2021): ``1 - C(n-c, k) / C(n, k)``.

    Args:
        n: samples per problem.
        c: correct samples.
        k: the k of pass@k (``k <= n``).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def humaneval_docs(dataset: Any) -> Any:
    """``process_docs``: the documents unchanged, after checking that their programs may run (lm-eval
    reads the documents before the model generates).

    Raises:
        SandboxUnavailableError: bubblewrap cannot run here and unsafe execution was not allowed.
    """
    require_sandbox(_options.allow_unsafe)
    return dataset


def humaneval_doc_to_text(doc: dict) -> str:
    """HumanEval prompt: the problem's prompt as the user message (``doc_to_text``)."""
    return chat_prompt(parse_row("humaneval", doc).question)


def humaneval_doc_to_target(doc: dict) -> str:
    """What a completion is checked with: the tests and ``check(entry_point)`` (``doc_to_target``)."""
    item = parse_row("humaneval", doc)
    return f"{item.test}\n\ncheck({item.entry_point})"


def humaneval_run_in_sandbox(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """The ``sandbox`` filter: each completion becomes the status of its program's sandboxed run
    (:attr:`lapheads.sandbox.ExecResult.status`), the task's programs ``workers`` at a time."""
    opts = _options
    programs, owners = [], []
    for i, (texts, doc) in enumerate(zip(resps, docs)):
        item = parse_row("humaneval", doc)
        for text in texts:
            prefix, body = humaneval_program(item, text)
            programs.append(build_humaneval_program(prefix, body, item.test or "", item.entry_point or ""))
            owners.append(i)
    results = run_many(programs, workers=opts.workers, timeout=opts.timeout, allow_unsafe=opts.allow_unsafe)
    statuses: list[list[str]] = [[] for _ in resps]
    for i, r in zip(owners, results):
        statuses[i].append(r.status)
    return statuses


def humaneval_pass_at_k(doc: dict, results: Sequence[list[str]]) -> dict[str, float]:
    """``process_results``: pass@k of one problem from the statuses of its samples."""
    statuses = results[0]
    n, c = len(statuses), sum(s == "passed" for s in statuses)
    return {f"pass@{k}": pass_at_k(n, c, k) for k in PASS_KS if k <= n}


# ------------------------------------------------------------------------------------- configs
def chat_task_config(name: str, path: Optional[str] = None, repeats: Optional[int] = None) -> dict[str, Any]:
    """The lm-eval config (for ``simple_evaluate(tasks=[...])``) of chat task ``name`` (``arc_easy`` ... ``humaneval``).

    With ``path``, the test split is that local JSONL (``.jsonl[.gz]``, as :mod:`lapheads.data.benchmarks`
    reads it) instead of the Hub data set; ``repeats`` sets the samples per problem.

    Raises:
        DataError: ``name`` is not a chat task.
    """
    from lm_eval.tasks._yaml_loader import load_yaml  # lazy: optional dependency (the eval extra)

    task = CHAT_TASKS[canonical_name(name)]
    cfg = load_yaml(TASKS_DIR / f"{task}.yaml", resolve_func=True, recursive=True)
    cfg.pop("tag", None)  # an inline config is not indexed: a tag would mean nothing
    if path is not None:
        cfg.update(
            dataset_path="json",
            dataset_name=None,
            dataset_kwargs={"data_files": {"test": str(path)}},
            test_split="test",
        )
    if repeats is not None:
        cfg["repeats"] = repeats
    return cfg
