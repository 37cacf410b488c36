"""Byte-level BPE tokenizer for the language-model recipes, trained with Hugging Face ``tokenizers``.

nanochat's split regex and special tokens (plus ``<|pad|>``), wrapped as a transformers fast
tokenizer whose ``tokenizer(text)`` prefixes ``<|bos|>``; :func:`render_chat` renders a
conversation with its loss mask as nanochat's SFT does. Design notes: ``docs/design/lm.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ..data.shards import tokenizer_hash  # noqa: F401  (defined beside the shards it fingerprints)
from ..errors import ConfigError, DataError

__all__ = [
    "SPECIAL_TOKENS",
    "PAD_TOKEN",
    "SPLIT_PATTERN",
    "train_tokenizer",
    "load_tokenizer",
    "render_chat",
    "tokenizer_hash",
    "stop_token_ids",
]

#: nanochat's special tokens, in nanochat's order.
SPECIAL_TOKENS = (
    "<|bos|> <|user_start|> <|user_end|> <|assistant_start|> <|assistant_end|> "
    "<|python_start|> <|python_end|> <|output_start|> <|output_end|>"
).split()
PAD_TOKEN = "<|pad|>"
ALL_SPECIAL_TOKENS = SPECIAL_TOKENS + [PAD_TOKEN]

#: GPT-4's pre-tokenisation regex with numbers split into groups of 1-2 digits (nanochat's choice:
#: it wastes fewer tokens on numbers in a small vocabulary).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

_MIN_VOCAB = 256 + len(ALL_SPECIAL_TOKENS)


def _backend(vocab_size: int):
    tok = Tokenizer(models.BPE(byte_fallback=False, unk_token=None, fuse_unk=False))
    tok.normalizer = None
    split = pre_tokenizers.Split(pattern=Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        min_frequency=0,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(ALL_SPECIAL_TOKENS),
    )
    return tok, trainer


def _wrap(backend: Any):
    """Wrap a ``tokenizers.Tokenizer`` as a transformers fast tokenizer with our special tokens."""
    bos_id = backend.token_to_id("<|bos|>")
    # Prefix BOS on tokenizer(text); pairs get one BOS each (documents are BOS-delimited).
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|assistant_end|>",
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|bos|>", "<|assistant_end|>")],
        clean_up_tokenization_spaces=False,
        model_max_length=int(1e30),
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Optional[str | os.PathLike] = None):
    """Train a byte-level BPE tokenizer.

    Args:
        texts: an iterable of documents (read once, streamed to the trainer).
        vocab_size: total vocabulary size including the 256 byte symbols and the 10 special tokens.
        out_dir: where to ``save_pretrained`` it (created); ``None`` keeps it in memory only.

    Returns:
        A ``PreTrainedTokenizerFast``.

    Raises:
        ConfigError: ``vocab_size`` too small for bytes + special tokens.
        DataError: the corpus is empty (no non-empty text).
    """
    if not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
        raise ConfigError(
            f"vocab_size={vocab_size!r} is too small: it must be an int >= {_MIN_VOCAB} "
            f"(256 byte symbols + {len(ALL_SPECIAL_TOKENS)} special tokens)"
        )
    docs = 0

    def _counted(it: Iterable[str]) -> Iterator[str]:
        nonlocal docs
        for i, t in enumerate(it):
            if not isinstance(t, str):
                raise DataError(f"document {i} of the tokenizer corpus is a {type(t).__name__}, not a str")
            if t:
                docs += 1
                yield t

    backend, trainer = _backend(vocab_size)
    backend.train_from_iterator(_counted(texts), trainer=trainer)
    if docs == 0:
        raise DataError("the tokenizer corpus is empty: no non-empty document was given")
    tok = _wrap(backend)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
    return tok


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer saved by :func:`train_tokenizer` (a directory, or its ``tokenizer.json``).

    Raises:
        DataError: the directory has no ``tokenizer.json``, it cannot be parsed, or it lacks the
            special tokens the recipes rely on.
    """
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise DataError(f"{p}: no tokenizer.json here; train one with `lapheads tokenizer train --out {p}`")
    saved_whole = p.is_dir() and (p / "tokenizer_config.json").is_file()
    try:
        loaded = AutoTokenizer.from_pretrained(str(p)) if saved_whole else Tokenizer.from_file(str(file))
    except Exception as e:  # corrupt JSON etc.: one clear line instead of a deep traceback
        raise DataError(f"{file}: cannot be loaded as a tokenizer ({type(e).__name__}: {e})") from e
    tok = loaded if saved_whole else _wrap(loaded)
    vocab = tok.get_vocab()
    missing = [t for t in ALL_SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise DataError(
            f"{file}: tokenizer lacks the special tokens {missing}; it was not made by `lapheads tokenizer train`"
        )
    return tok


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end a generation: ``<|assistant_end|>`` (chat) and ``<|bos|>`` (a new document)."""
    return [tokenizer.convert_tokens_to_ids("<|assistant_end|>"), tokenizer.convert_tokens_to_ids("<|bos|>")]


# --------------------------------------------------------------------------- chat rendering
def _special(tokenizer: Any, name: str) -> int:
    i = tokenizer.convert_tokens_to_ids(name)
    if i is None or i == getattr(tokenizer, "unk_token_id", -1):
        raise DataError(f"the tokenizer has no special token {name}; use one made by `lapheads tokenizer train`")
    return i


def _content_parts(content: Any, idx: int, role: str) -> list[tuple[str, str]]:
    if isinstance(content, str):
        return [("text", content)]
    if role == "assistant" and isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("text", "python", "python_output")
                or not isinstance(part.get("text"), str)
            ):
                raise DataError(
                    f"messages[{idx}].content[{j}] must be {{'type': 'text'|'python'|'python_output', "
                    f"'text': str}}, got {part!r}"
                )
            parts.append((part["type"], part["text"]))
        return parts
    raise DataError(
        f"messages[{idx}] ({role}) content must be a string"
        + (" or a list of parts" if role == "assistant" else "")
        + f", got {type(content).__name__}"
    )


def render_chat(
    tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False, max_tokens: Optional[int] = None
) -> tuple[list[int], list[int]]:
    """Render a conversation to token ids and a loss mask (nanochat's format).

    Args:
        tokenizer: a tokenizer from :func:`train_tokenizer` / :func:`load_tokenizer`.
        messages: ``[{"role": "system"|"user"|"assistant", "content": ...}, ...]``: an optional system
            message first, then user and assistant alternating, starting with user.
        add_generation_prompt: the conversation ends with a user message; append
            ``<|assistant_start|>`` so a model continues with the reply.
        max_tokens: truncate to this many tokens (SFT sequence length).

    Returns:
        ``(ids, mask)`` of equal length: mask is 1 on assistant content and ``<|assistant_end|>``
        (what the model should learn to produce), 0 elsewhere (BOS, user turns, role markers, tool output).

    Raises:
        DataError: naming the message index, for an unknown role, a wrong order, or bad content.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ("system", "user", "assistant"):
            raise DataError(f"messages[{i}] has unknown role {m['role']!r}; allowed: system, user, assistant")
    msgs = [dict(m) for m in messages]
    offset = 0
    if msgs[0]["role"] == "system":
        if len(msgs) < 2 or msgs[1]["role"] != "user":
            raise DataError("messages[1] must be a user message after the system message at messages[0]")
        for name, i in (("system", 0), ("user", 1)):
            if not isinstance(msgs[i]["content"], str):
                raise DataError(f"messages[{i}] ({name}) content must be a string")
        # nanochat has no system turn: the system prompt is prepended to the first user message.
        msgs[1]["content"] = msgs[0]["content"] + "\n\n" + msgs[1]["content"]
        msgs, offset = msgs[1:], 1
    for j, m in enumerate(msgs):
        want = "user" if j % 2 == 0 else "assistant"
        if m["role"] != want:
            why = "a second system message" if m["role"] == "system" else f"a {m['role']} message"
            raise DataError(
                f"messages[{j + offset}] is {why} where a {want} message is expected "
                "(optional system first, then user and assistant alternating, starting with user)"
            )
    if add_generation_prompt and msgs[-1]["role"] != "user":
        raise DataError(
            f"messages[{len(messages) - 1}] is an assistant message; add_generation_prompt needs "
            "the conversation to end with a user message"
        )

    ids: list[int] = []
    mask: list[int] = []

    def add(tokens: list[int], m: int) -> None:
        ids.extend(tokens)
        mask.extend([m] * len(tokens))

    def enc(text: str) -> list[int]:
        # split_special_tokens: a message that CONTAINS "<|assistant_end|>" is text, not a turn
        # boundary (nanochat's encode_ordinary); otherwise users could forge turns.
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    sp = {n: _special(tokenizer, n) for n in SPECIAL_TOKENS}

    def add_between(name: str, text: str, m: int) -> None:  # <|name_start|> text <|name_end|>
        add([sp[f"<|{name}_start|>"], *enc(text), sp[f"<|{name}_end|>"]], m)

    add([sp["<|bos|>"]], 0)
    for j, m in enumerate(msgs):
        parts = _content_parts(m["content"], j + offset, m["role"])
        if m["role"] == "user":
            add_between("user", parts[0][1], 0)
            continue
        add([sp["<|assistant_start|>"]], 0)
        for kind, text in parts:
            if kind == "text":
                add(enc(text), 1)
            else:  # tool output comes from the interpreter at inference time: not trained on
                add_between("python" if kind == "python" else "output", text, int(kind == "python"))
        add([sp["<|assistant_end|>"]], 1)
    if add_generation_prompt:
        add([sp["<|assistant_start|>"]], 0)
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return ids, mask
