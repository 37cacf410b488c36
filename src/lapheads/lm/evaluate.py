"""``lapheads eval lm``: chat benchmarks and lm-evaluation-harness tasks on a trained LM run, all run by lm-eval.

``lapheads eval lm --run runs/sft --tasks arc_easy=ARC-Easy-Test.jsonl,mmlu=mmlu.jsonl,gsm8k=gsm8k.jsonl,humaneval``
``lapheads eval lm --run runs/lm --lm-eval my_task --lm-eval-include tasks_dir/``

:func:`run_chat_tasks` runs the chat tasks of :mod:`lapheads.lm.tasks`, :func:`run_lm_eval` any other lm-eval
task, both offline unless ``allow_network``. Design notes: ``docs/design/lm.md``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

from ..data.benchmarks import LETTERS, builtin_humaneval_path, canonical_name, load_benchmark
from ..errors import ConfigError, DataError
from ..sandbox import require_sandbox
from . import tasks as chat_tasks
from .tokenizer import SPECIAL_TOKENS

__all__ = [
    "LM_EVAL_BOOTSTRAP_ITERS",
    "parse_tasks",
    "check_chat_tasks",
    "make_lm_eval_model",
    "lm_eval_task_manager",
    "run_lm_eval",
    "run_chat_tasks",
    "evaluate_chat_lm",
    "chatcore",
]

#: lm-eval's own default number of bootstrap resamples (``simple_evaluate(bootstrap_iters=...)``).
LM_EVAL_BOOTSTRAP_ITERS = 100000

#: The chat tasks' ``HFLM.max_length``: longer than any prompt, so nothing is truncated.
_UNTRUNCATED = 1 << 30

#: Where a chat task without a local file reads its documents (the Hub data set of its YAML).
_HUB = "hub"


def parse_tasks(spec: str) -> dict[str, Optional[str]]:
    """``"arc_easy=PATH,mmlu=PATH,humaneval"`` -> ``{"arc_easy": "PATH", "mmlu": "PATH", "humaneval": None}``.

    Raises:
        ConfigError: an empty entry or a task named twice.
    """
    out: dict[str, Optional[str]] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ConfigError(f"--tasks {spec!r} has an empty entry; use name=PATH,name=PATH")
        name, _, path = part.partition("=")
        name = name.strip()
        if not name or name in out:
            raise ConfigError(f"--tasks {spec!r}: task {name!r} is empty or given twice")
        out[name] = path.strip() or None
    return out


def check_chat_tasks(
    tasks: dict[str, Optional[str]], allow_network: bool = False, allow_unsafe_code: bool = False
) -> dict[str, str]:
    """Check the ``--tasks`` of ``lapheads eval lm`` before any model work; returns name -> data source.

    A source is the file's path, or ``"hub"`` for a task without a file (which needs ``allow_network``).

    Raises:
        DataError: an unknown task or a bad task file (naming file and line).
        ConfigError: two names for one task, a task without a file offline.
        SandboxUnavailableError: HumanEval is asked for and bubblewrap cannot run here.
    """
    if not tasks:
        raise ConfigError("no chat task given; use --tasks name=PATH,...")
    sources: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name, path in tasks.items():
        key = canonical_name(name)
        if key in seen:
            raise ConfigError(f"--tasks names {key} twice ({seen[key]!r} and {name!r})")
        seen[key] = name
        if path is None and key == "humaneval":
            path = builtin_humaneval_path()
        if path is None and not allow_network:
            raise ConfigError(
                f"task {name!r} needs a local JSONL (--tasks {name}=PATH), or --allow-network to read its Hub data set"
            )
        if path is not None:
            load_benchmark(name, path)  # validates the whole file, naming file:line
        sources[name] = _HUB if path is None else str(path)
        if key == "humaneval":
            require_sandbox(allow_unsafe_code)  # generated code needs the sandbox
    return sources


def _offline() -> None:
    """The hub and ``datasets`` offline unless the environment says otherwise (variables and, for modules
    imported already, their module-level switches)."""
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")

    def on(k: str) -> bool:
        return os.environ[k].strip().upper() in ("1", "ON", "YES", "TRUE")

    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = on("HF_HUB_OFFLINE") or on("TRANSFORMERS_OFFLINE")
    ds = sys.modules.get("datasets.config")
    if ds is not None:
        ds.HF_HUB_OFFLINE = ds.HF_DATASETS_OFFLINE = on("HF_DATASETS_OFFLINE")


def make_lm_eval_model(
    model: Any, tokenizer: Any, batch_size: int = 8, max_length: Optional[int] = None, max_gen_toks: int = 256
):
    """lm-eval's view of an in-memory transformers causal LM: a :class:`lapheads.lm.hflm.LapheadsHFLM`.

    Args:
        model, tokenizer: a transformers causal LM (Laplacian heads included) and its tokenizer.
        batch_size: requests per forward pass.
        max_length: context length (default: the model config's ``max_position_embeddings``).
        max_gen_toks: ``generate_until``'s default number of new tokens (a task's own value wins).

    Raises:
        ConfigError: lm-evaluation-harness or ``accelerate`` is not installed.
    """
    _require_lm_eval()
    from .hflm import LapheadsHFLM  # lazy: imports lm-eval (the eval extra)

    return LapheadsHFLM(
        pretrained=model.eval(),
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_length=max_length,
        max_gen_toks=max_gen_toks,
    )


def _require_lm_eval(allow_network: bool = True) -> None:
    """One clear line when the eval extra (lm-eval, ``accelerate``) is missing; offline unless ``allow_network``."""
    missing = [m for m in ("lm_eval", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"lm-eval evaluation needs {' and '.join(missing)}; pip install 'lapheads[eval]'")
    if not allow_network:
        _offline()


def lm_eval_task_manager(tasks: Sequence[str], include_path: Optional[str] = None, allow_network: bool = False):
    """lm-eval's ``TaskManager`` of :mod:`lapheads.lm.tasks` and ``include_path``, after checking that every
    task in ``tasks`` exists (no model needed: ``lapheads eval lm`` calls it before loading one).

    Raises:
        ConfigError: an unknown task (the message says where lm-eval looked), a missing include dir, or
            lm-evaluation-harness / ``accelerate`` not installed.
    """
    _require_lm_eval(allow_network)
    if include_path is not None and not Path(include_path).is_dir():
        what = "does not exist" if not Path(include_path).exists() else "is a file"
        raise ConfigError(f"--lm-eval-include {include_path} {what}; give a directory of lm-eval task YAML files")
    from lm_eval.tasks import TaskManager  # lazy: optional dependency (the eval extra)

    # Indexing lm-eval's built-in tasks takes seconds: only when a task is not in these directories.
    # The include directory comes last: lm-eval lets a later directory override a task name.
    paths = [str(chat_tasks.TASKS_DIR)] + ([include_path] if include_path else [])
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(t in local.all_subtasks for t in tasks):
        return local
    tm = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        where = f"{include_path}, lapheads' chat tasks" if include_path else "lapheads' chat tasks"
        hint = "" if include_path else "; pass --lm-eval-include DIR for local task YAML files"
        raise ConfigError(f"lm-eval task(s) {unknown} not found in {where} or lm-eval's built-in tasks{hint}")
    return tm


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    include_path: Optional[str] = None,
    limit: Optional[int] = None,
    num_fewshot: Optional[int] = None,
    batch_size: int = 8,
    allow_network: bool = False,
    seed: int = 0,
    bootstrap_iters: int = LM_EVAL_BOOTSTRAP_ITERS,
    task_manager: Any = None,
    allow_unsafe_code: bool = False,
) -> dict[str, Any]:
    """Run lm-evaluation-harness tasks on an in-memory model.

    Args:
        model, tokenizer: a transformers causal LM and its lapheads tokenizer.
        tasks: lm-eval task names (built-in, lapheads' chat tasks or from ``include_path``).
        include_path: a directory of task YAML files (lm-eval's ``TaskManager(include_path=...)``).
        limit: at most this many documents per task.
        num_fewshot: few-shot examples (task default when None).
        batch_size: requests per forward pass.
        allow_network: do not force ``datasets`` / the hub offline.
        seed: lm-eval's random seeds.
        bootstrap_iters: bootstrap resamples for the standard errors (0 = none).
        task_manager: from :func:`lm_eval_task_manager` (built and checked here when None).
        allow_unsafe_code: run ``lapheads_chat_humaneval`` programs without bubblewrap where it cannot.

    Returns:
        lm-eval's ``results`` (per task metrics) plus ``n-samples`` and the task configs' versions.

    Raises:
        ConfigError: an unknown task (the message lists where lm-eval looked), a missing include dir.
    """
    tm = task_manager or lm_eval_task_manager(tasks, include_path, allow_network)
    lm = make_lm_eval_model(model, tokenizer, batch_size=batch_size)
    with chat_tasks.sandbox_options(allow_unsafe=allow_unsafe_code):
        res = _simple_evaluate(
            lm, list(tasks), tm, limit, seed, bootstrap_iters, num_fewshot=num_fewshot, log_samples=False
        )
    return _plain(res)


def _simple_evaluate(
    lm: Any, tasks: list, tm: Any, limit: Optional[int], seed: int, bootstrap_iters: int, **kwargs: Any
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` with every random seed set to ``seed``."""
    import lm_eval  # lazy: optional dependency (the eval extra)

    seeds = dict(random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    res = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=tm, limit=limit, bootstrap_iters=bootstrap_iters, **kwargs, **seeds
    )
    if res is None:  # only rank 0 of a distributed lm-eval returns results; we run single-process
        raise DataError("lm-eval returned no results")
    return res


def _plain(res: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's results, n-samples, versions and n-shot as plain JSON types."""
    keep = {k: res[k] for k in ("results", "n-samples", "versions", "n-shot") if k in res}
    return json.loads(json.dumps(keep, default=str))


def run_chat_tasks(
    model: Any,
    tokenizer: Any,
    tasks: dict[str, Optional[str]],
    batch_size: int = 8,
    max_new_tokens: int = 256,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run the chat tasks of :mod:`lapheads.lm.tasks` on an in-memory model with lm-eval.

    Args:
        model, tokenizer: a transformers causal LM and its tokenizer (with the chat special tokens).
        tasks: ``--tasks`` name (``arc_easy``, ``arc_challenge``, ``mmlu``, ``gsm8k``, ``humaneval``,
            or a spelling such as ``ARC-Easy``) -> local JSONL path (None: see :func:`check_chat_tasks`).
        batch_size: requests per forward pass / ``generate`` call.
        max_new_tokens: generation length (GSM8K, HumanEval).
        **kwargs: the options of :func:`evaluate_chat_lm`.

    Raises:
        ConfigError: as :func:`evaluate_chat_lm`, or a tokenizer without the chat special tokens.
        DataError, SandboxUnavailableError: as :func:`evaluate_chat_lm`, before the model runs.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ConfigError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    _check_sampling(kwargs.get("num_samples", 1), kwargs.get("temperature", 0.0))
    kwargs["sources"] = kwargs.get("sources") or check_chat_tasks(
        tasks, kwargs.get("allow_network", False), kwargs.get("allow_unsafe_code", False)
    )
    _require_chat_tokens(tokenizer)
    lm = make_lm_eval_model(
        model, tokenizer, batch_size=batch_size, max_length=_UNTRUNCATED, max_gen_toks=max_new_tokens
    )
    return evaluate_chat_lm(lm, tasks, **kwargs)


def evaluate_chat_lm(
    lm: Any,
    tasks: dict[str, Optional[str]],
    max_items: Optional[int] = None,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    seed: int = 0,
    allow_unsafe_code: bool = False,
    sandbox_timeout: float = 5.0,
    sandbox_workers: int = 2,
    bootstrap_iters: int = LM_EVAL_BOOTSTRAP_ITERS,
    allow_network: bool = False,
    sources: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Run the chat tasks through ``lm_eval.simple_evaluate`` on an lm-eval model (any ``lm_eval.api.model.LM``).

    Args:
        lm: the lm-eval model (:func:`run_chat_tasks` makes a ``LapheadsHFLM``).
        tasks: ``--tasks`` name -> local JSONL path (None: see :func:`check_chat_tasks`).
        max_items: at most this many documents per task (lm-eval's ``limit``: the first ones).
        num_samples: completions per HumanEval problem (n of pass@k; lm-eval's ``repeats``); GSM8K uses one.
        temperature: 0 = greedy (the tasks' own setting); > 0 samples every generated answer.
        top_k: top-k filtering when sampling (default: none).
        seed: lm-eval's random seeds (sampling included).
        allow_unsafe_code: run HumanEval programs without bubblewrap where it cannot run.
        sandbox_timeout: wall-clock seconds per HumanEval program.
        sandbox_workers: programs run at once.
        bootstrap_iters: lm-eval's bootstrap resamples for the standard errors (0 = none).
        allow_network: do not force ``datasets`` / the hub offline; tasks without a file read the Hub.
        sources: from :func:`check_chat_tasks` (checked here when None).

    Returns:
        ``{"chat": {name: {metric, accuracy, total, baseline, ...}, ..., "chatcore": float},
        "lm_eval": lm-eval's results, n-samples, versions and n-shot of the chat tasks}``.

    Raises:
        ConfigError: bad options, lm-eval missing.
        DataError: a task file is missing or malformed.
        SandboxUnavailableError: HumanEval cannot be sandboxed and ``allow_unsafe_code`` is not set.
    """
    _check_sampling(num_samples, temperature)
    sources = sources or check_chat_tasks(tasks, allow_network, allow_unsafe_code)
    _require_lm_eval(allow_network)
    from lm_eval.tasks import TaskManager  # lazy: optional dependency (the eval extra)

    names = {chat_tasks.CHAT_TASKS[canonical_name(n)]: n for n in sources}  # lm-eval task -> --tasks name
    configs = [
        chat_tasks.chat_task_config(
            n, None if src == _HUB else src, num_samples if canonical_name(n) == "humaneval" else None
        )
        for n, src in sources.items()
    ]
    gen_kwargs = {"do_sample": True, "temperature": temperature, "top_k": top_k or 0} if temperature > 0 else None
    tm = TaskManager(include_path=str(chat_tasks.TASKS_DIR), include_defaults=False)
    with chat_tasks.sandbox_options(timeout=sandbox_timeout, workers=sandbox_workers, allow_unsafe=allow_unsafe_code):
        res = _simple_evaluate(
            lm, configs, tm, max_items, seed, bootstrap_iters, gen_kwargs=gen_kwargs, log_samples=True
        )
    chat = {names[t]: _chat_summary(t, res["results"][t], res["samples"][t]) for t in names}
    chat["chatcore"] = chatcore(chat)
    return {"chat": chat, "lm_eval": _plain(res)}


def _check_sampling(num_samples: int, temperature: float) -> None:
    if num_samples < 1:
        raise ConfigError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if num_samples > 1 and temperature == 0:
        raise ConfigError("num_samples > 1 needs temperature > 0 (greedy samples are identical)")


def chatcore(results: dict[str, Any]) -> float:
    """nanochat's ChatCORE: the mean over tasks of ``(accuracy - baseline) / (1 - baseline)``."""
    rows = [r for r in results.values() if isinstance(r, dict)]
    return sum((r["accuracy"] - r["baseline"]) / (1 - r["baseline"]) for r in rows) / len(rows)


def _require_chat_tokens(tokenizer: Any) -> None:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    missing = [t for t in SPECIAL_TOKENS[:5] if t not in vocab]  # <|bos|>, user and assistant start/end
    if missing:
        raise ConfigError(
            f"the chat tasks need a tokenizer with the chat special tokens; {missing} are missing "
            "(use lm-eval's own tasks with --lm-eval for a model without them)"
        )


def _chat_summary(task: str, metrics: dict[str, Any], samples: list[dict]) -> dict[str, Any]:
    """One chat task's entry of the report: lm-eval's score and the per-item answers of its samples."""
    total = len(samples)
    if task == chat_tasks.CHAT_TASKS["humaneval"]:
        statuses = [s["filtered_resps"][0] for s in samples]
        passed = [sum(st == "passed" for st in row) for row in statuses]
        out: dict[str, Any] = {
            "metric": "pass@1",
            "total": total,
            "num_samples": len(statuses[0]),
            "passed_samples": sum(passed),
            "baseline": 0.0,
            "statuses": dict(Counter(st for row in statuses for st in row)),
            "per_problem": {s["doc"]["task_id"]: c for s, c in zip(samples, passed)},
        }
        reported = [k for k in chat_tasks.PASS_KS if f"pass@{k},sandbox" in metrics]
        out.update({f"pass@{k}": metrics[f"pass@{k},sandbox"] for k in reported})
        out["accuracy"] = out["pass@1"]
        return out
    if task == chat_tasks.CHAT_TASKS["gsm8k"]:
        return {
            "metric": "accuracy",
            "accuracy": metrics["exact_match,final_number"],
            "correct": int(sum(s["exact_match"] for s in samples)),
            "total": total,
            "baseline": 0.0,
            "answers": [s["filtered_resps"][0] or None for s in samples],
        }
    # multiple choice: one (log-likelihood, is_greedy) per letter
    preds = [max(range(len(s["filtered_resps"])), key=lambda i, s=s: s["filtered_resps"][i][0]) for s in samples]
    return {
        "metric": "accuracy",
        "accuracy": metrics["acc,none"],
        "correct": int(sum(s["acc"] for s in samples)),
        "total": total,
        "baseline": sum(1 / len(s["filtered_resps"]) for s in samples) / total,
        "predictions": [LETTERS[p] for p in preds],
    }
