"""Documents (:mod:`lapheads.data.text`) -> BOS-prefixed token shards on disk, resumable, and a sampler over
them for language-model training (docs/design/data.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError, DiskFullError
from ..outputs import atomic_write
from .text import check_val_fraction, is_validation_document

__all__ = ["tokenize_to_shards", "TokenShards", "INDEX_NAME", "SPLITS", "read_index", "tokenizer_hash"]

INDEX_NAME = "index.json"
_INDEX_VERSION = 1
SPLITS = ("train", "val")


# How `lapheads data tokenize` spells the options named in errors (`train lm` passes its own).
_CLI_HINTS = {
    "val_fraction": "--val-fraction",
    "val_by": "--val-by tokens",
    "split_documents": "--split-documents blank_lines|chapters|N",
    "fraction": "train_fraction",
}
# Settings an index written before they existed implicitly had.
_SETTING_DEFAULTS = {"val_by": "documents", "train_fraction": "1", "max_train_documents": 0}


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """``atomic_write``, whose DiskFullError tells how to resume (the shards written before stay)."""
    try:
        atomic_write(path, data)  # readers see the old file or the complete new one, never half of it
    except DiskFullError as e:
        resume = "the same command with --resume (the shards written so far are kept)"
        raise DiskFullError(e.directory, e.needed, e.free, e.what, run=path.parent, resume=resume) from None


def _write_index(out: Path, index: dict) -> None:
    _atomic_write_bytes(out / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())


def read_index(path: str | os.PathLike) -> dict:
    """Load ``index.json`` of a shard directory (a DataError when it is missing or unreadable)."""
    f = Path(path) / INDEX_NAME
    if not f.is_file():
        raise DataError(f"{Path(path)}: no {INDEX_NAME}; make shards with `lapheads data tokenize --out {path}`")
    try:
        index = json.loads(f.read_text())
    except (json.JSONDecodeError, OSError) as e:
        raise DataError(f"{f}: cannot be read as JSON ({e})") from e
    if index.get("version") != _INDEX_VERSION or "splits" not in index:
        raise DataError(f"{f}: not a lapheads token-shard index (version {index.get('version')!r})")
    return index


def tokenize_to_shards(
    documents: Iterable[str],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    shard_tokens: int = 2**24,
    val_fraction: float = 0.05,
    resume: bool = False,
    dtype: Optional[str] = None,
    batch_documents: int = 256,
    total_documents: Optional[int] = None,
    source: str = "",
    progress: bool = True,
    val_by: str = "documents",
    train_fraction: float = 1.0,
    max_train_documents: int = 0,
    hints: Optional[dict[str, str]] = None,
) -> dict:
    """Tokenize documents into BOS-prefixed token shards with a validation split; returns the final
    index (also written to ``out_dir/index.json``).

    Args:
        documents: the corpus, one ``str`` per document, in a fixed order (resume relies on it).
        tokenizer: a transformers tokenizer (its ``bos_token_id`` is prefixed to every document).
        out_dir: output directory: ``train_000000.bin``, ..., ``val_000000.bin``, ``index.json``.
        shard_tokens: a shard is closed at the first document boundary at or past this many tokens.
        val_fraction: fraction of documents (``val_by="documents"``, see :func:`is_validation_document`)
            or of every document's last tokens (``val_by="tokens"``) in the validation split.
        resume: continue an interrupted run in ``out_dir`` (the settings must match its index).
        dtype: ``"uint16"`` / ``"uint32"``; default: the smallest that holds the vocabulary.
        batch_documents: documents per ``encode_batch`` call (the Rust tokenizer runs them in parallel).
        total_documents, progress: the progress bar's total (for ``documents`` without ``len``) and switch.
        source: a description of the input, stored in the index and used in messages.
        train_fraction, max_train_documents: share of, and cap (0 = none) on, the training documents kept.
        hints: how the caller spells the options in error messages: keys ``val_fraction``,
            ``val_by``, ``split_documents``, ``fraction`` (default: the ``data tokenize`` flags).
    """
    out = Path(out_dir)
    f = check_val_fraction(val_fraction)
    settings = _shard_settings(tokenizer, shard_tokens, f, dtype, val_by, train_fraction, max_train_documents)
    if (out / INDEX_NAME).exists():
        if not resume:
            raise DataError(
                f"{out / INDEX_NAME} already exists; pass resume=True (--resume) to continue it "
                "or choose an empty --out directory"
            )
        index = read_index(out)
        for k, v in settings.items():
            if index.get(k, _SETTING_DEFAULTS.get(k)) != v:
                what = "tokenizer" if k in ("tokenizer_hash", "vocab_size", "bos_id") else k
                raise DataError(
                    f"{out / INDEX_NAME}: cannot resume with a different {what}: the index has "
                    f"{k}={index.get(k)!r}, this run has {v!r}"
                )
        if index.get("complete"):
            return index
    else:
        out.mkdir(parents=True, exist_ok=True)
        index = {
            "version": _INDEX_VERSION,
            **settings,
            "source": source,
            "complete": False,
            "documents_consumed": 0,
            "splits": {
                s: {"shards": [], "tokens": 0, "bytes": 0, "documents": 0, "next_document": 0, "bytes_per_token": None}
                for s in SPLITS
            },
        }
    writer = _ShardWriter(out, index, settings, tokenizer, f, source)
    if total_documents is None and hasattr(documents, "__len__"):
        total_documents = len(documents)
    seen = writer.run(documents, batch_documents, total_documents, progress)
    where = f" {source}" if source else ""
    splits = index["splits"]
    committed = max(splits[s]["next_document"] for s in SPLITS)
    if seen < committed:
        raise DataError(
            f"{out / INDEX_NAME}: the resumed run already holds {committed} input documents but "
            f"the input{where} has only {seen}; resume with the same input, in the same order"
        )
    if seen == 0 or (writer.nonempty == 0 and all(splits[s]["documents"] == 0 for s in SPLITS)):
        raise DataError(f"the corpus{where} is empty: no non-empty document to tokenize")
    for s in SPLITS:
        writer.flush(s, seen)
    if splits["train"]["tokens"] == 0:
        hints = {**_CLI_HINTS, **(hints or {})}
        if val_by == "tokens":
            why = f"{hints['fraction']}={train_fraction} and val_fraction={val_fraction} leave no training token"
        else:
            why = (
                f"validation by document ({hints['val_fraction']}={val_fraction}) leaves no training "
                f"document (the first document is always validation)"
            )
        raise DataError(
            f"the corpus{where} has {seen} document(s) and {why}; split the text into documents "
            f"({hints['split_documents']}), validate by tokens ({hints['val_by']}) or give more "
            f"documents"
        )
    index["documents_consumed"] = seen
    index["complete"] = True
    _write_index(out, index)
    return index


def _shard_settings(
    tokenizer: Any,
    shard_tokens: int,
    f: Fraction,
    dtype: Optional[str],
    val_by: str,
    train_fraction: float,
    max_train_documents: int,
) -> dict:
    """The checked settings of a shard directory, as its index records them (a resume must match them)."""
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"shard_tokens={shard_tokens!r} must be a positive int")
    vocab = len(tokenizer)
    bos = tokenizer.bos_token_id
    if bos is None:
        raise DataError("the tokenizer has no bos_token; every document is prefixed with BOS")
    dtype = dtype or ("uint16" if vocab <= 2**16 else "uint32")
    if dtype not in ("uint16", "uint32"):
        raise ConfigError(f"dtype={dtype!r} must be 'uint16' or 'uint32'")
    if vocab > np.iinfo(dtype).max + 1:
        raise DataError(
            f"the tokenizer has {vocab} tokens, which do not fit {dtype} shards "
            f"(max {np.iinfo(dtype).max + 1}); use uint32"
        )
    if val_by not in ("documents", "tokens"):
        raise ConfigError(f"val_by={val_by!r} must be 'documents' or 'tokens'")
    if not isinstance(train_fraction, (int, float)) or not 0 < train_fraction <= 1:
        raise ConfigError(f"train_fraction={train_fraction!r} must be a number in (0, 1]")
    if not isinstance(max_train_documents, int) or max_train_documents < 0:
        raise ConfigError(f"max_train_documents={max_train_documents!r} must be an int >= 0")
    g = Fraction(str(train_fraction)).limit_denominator(10**6)
    return {
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": vocab,
        "dtype": dtype,
        "bos_id": int(bos),
        "shard_tokens": shard_tokens,
        "val_fraction": str(f),
        "val_by": val_by,
        "train_fraction": str(g),
        "max_train_documents": max_train_documents,
    }


class _ShardWriter:
    """Tokenizes documents into the splits of one shard directory (its new or resumed, checked ``index``)."""

    def __init__(self, out: Path, index: dict, settings: dict, tokenizer: Any, f: Fraction, source: str):
        self.out, self.index, self.tokenizer, self.f, self.source = out, index, tokenizer, f, source
        self.g = Fraction(settings["train_fraction"])
        self.splits = index["splits"]
        self.by_tokens = settings["val_by"] == "tokens"
        self.max_train = settings["max_train_documents"]
        self.vocab, self.bos, self.shard_tokens = settings["vocab_size"], settings["bos_id"], settings["shard_tokens"]
        self.np_dtype = np.dtype(settings["dtype"])
        self.buffers: dict[str, list] = {s: [] for s in SPLITS}  # lists of token arrays, one per document
        self.pending = {s: {"tokens": 0, "bytes": 0, "documents": 0} for s in SPLITS}
        self.nonempty = 0
        # corpus text such as "<|bos|>" is not a special token; the flag is restored (the tokenizer is the caller's)
        self.backend = getattr(tokenizer, "backend_tokenizer", None)

    def flush(self, split: str, next_doc: int) -> None:
        """Write the buffered documents of ``split`` as one shard and record it in the index."""
        sp, pend = self.splits[split], self.pending[split]
        if pend["tokens"]:
            name = f"{split}_{len(sp['shards']):06d}.bin"
            _atomic_write_bytes(self.out / name, np.concatenate(self.buffers[split]).tobytes())
            sp["shards"].append({"file": name, **pend})
            for k in ("tokens", "bytes", "documents"):
                sp[k] += pend[k]
            sp["bytes_per_token"] = sp["bytes"] / sp["tokens"]
        sp["next_document"] = next_doc
        # Input documents fully committed to disk: a restart never needs to tokenize these again.
        self.index["documents_consumed"] = min(self.splits[s]["next_document"] for s in SPLITS)
        self.buffers[split].clear()
        self.pending[split] = {"tokens": 0, "bytes": 0, "documents": 0}
        _write_index(self.out, self.index)

    def keep_train(self, i: int) -> bool:
        """Whether the training part of document ``i`` is kept (``train_fraction``, ``max_train_documents``)."""
        j = i if self.by_tokens else i - math.ceil(i * self.f)  # its position among the training documents
        return math.ceil((j + 1) * self.g) > math.ceil(j * self.g) and (
            not self.max_train or math.ceil(j * self.g) < self.max_train
        )

    def done_or_dropped(self, i: int) -> bool:
        """Document ``i`` needs no tokenizing: every split it feeds holds it already, or it is left out."""
        if self.by_tokens:
            return i < self.splits["val"]["next_document"] and (
                i < self.splits["train"]["next_document"] or not self.keep_train(i)
            )
        split = "val" if is_validation_document(i, self.f) else "train"
        return i < self.splits[split]["next_document"] or (split == "train" and not self.keep_train(i))

    def parts_of(self, i: int, text: str, ids: list, enc: Any) -> list[tuple[str, list, str]]:
        """``(split, token ids, text)`` pieces of document ``i`` still to be written."""
        if not self.by_tokens:
            parts = [("val" if is_validation_document(i, self.f) else "train", ids, text)]
        else:
            cut = len(ids) - math.floor(len(ids) * self.f + Fraction(1, 2))
            if cut >= len(ids):
                at = len(text)
            elif enc is not None:
                at = enc.offsets[cut][0]
            else:
                at = len(self.tokenizer.decode(ids[:cut]))
            parts = [("train", ids[:cut], text[:at]), ("val", ids[cut:], text[at:])]
        return [
            (s, x, t)
            for s, x, t in parts
            if x and i >= self.splits[s]["next_document"] and (s == "val" or self.keep_train(i))
        ]

    def process(self, batch: list[tuple[int, str]]) -> None:
        """Tokenize a batch of ``(index, text)`` documents into the split buffers (flushing full shards)."""
        texts = [t for _, t in batch]
        be = self.backend
        encs = be.encode_batch(texts, add_special_tokens=False) if be is not None else [None] * len(texts)
        for (i, text), enc in zip(batch, encs):
            ids = (
                enc.ids
                if enc is not None
                else self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            )
            if len(ids) and max(ids) >= self.vocab:
                raise DataError(
                    f"document {i} of {self.source or 'the corpus'} produced token id {max(ids)} "
                    f">= vocabulary size {self.vocab}"
                )
            for split, part, part_text in self.parts_of(i, text, list(ids), enc):
                arr = np.array([self.bos, *part], dtype=self.np_dtype)  # the ids fit: checked against the vocabulary
                self.buffers[split].append(arr)
                p = self.pending[split]
                p["tokens"] += len(arr)
                p["bytes"] += len(part_text.encode("utf-8"))
                p["documents"] += 1
                self.nonempty += 1
                if p["tokens"] >= self.shard_tokens:
                    self.flush(split, i + 1)
        self.bar.update(len(batch))
        tokens = {f"{s}_tokens": self.splits[s]["tokens"] + self.pending[s]["tokens"] for s in SPLITS}
        self.bar.set_postfix(tokens, refresh=False)

    def run(self, documents: Iterable[str], batch_documents: int, total: Optional[int], progress: bool) -> int:
        """Read every document (tokenizing those not written yet); returns how many were read."""
        self.bar = tqdm(
            total=total,
            unit="doc",
            desc=f"tokenize -> {self.out.name}",
            disable=None if progress else True,  # None: only on a terminal
            dynamic_ncols=True,
        )
        old_flag = getattr(self.backend, "encode_special_tokens", None)
        seen = 0  # input documents read so far (including those a resumed run skips)
        batch: list[tuple[int, str]] = []
        try:
            if self.backend is not None:
                self.backend.encode_special_tokens = True
            for i, text in enumerate(documents):
                seen = i + 1
                if not isinstance(text, str):
                    raise DataError(
                        f"document {i} of {self.source or 'the corpus'} is a {type(text).__name__}, not a str"
                    )
                # Empty documents are skipped (nothing to learn); documents already inside a complete
                # shard of their split (a resumed run) are read but not tokenized again.
                if not text or self.done_or_dropped(i):
                    self.bar.update(1)
                    continue
                batch.append((i, text))
                if len(batch) >= batch_documents:
                    self.process(batch)
                    batch = []
            if batch:
                self.process(batch)
        finally:
            self.bar.close()
            if self.backend is not None:
                self.backend.encode_special_tokens = old_flag
        return seen


class TokenShards:
    """The token shards of one split (``"train"`` or ``"val"``) of a directory written by
    :func:`tokenize_to_shards`, memory-mapped; a given ``tokenizer`` must be the one they were made with."""

    def __init__(self, path: str | os.PathLike, split: str = "train", tokenizer: Any = None):
        if split not in SPLITS:
            raise ConfigError(f"split={split!r}; allowed: {list(SPLITS)}")
        self.path = Path(path)
        self.split = split
        self.index = read_index(self.path)
        if not self.index.get("complete"):
            raise DataError(
                f"{self.path / INDEX_NAME}: the shards are incomplete (an interrupted run); "
                f"finish them with `lapheads data tokenize ... --out {self.path} --resume`"
            )
        if tokenizer is not None:
            h = tokenizer_hash(tokenizer)
            if h != self.index["tokenizer_hash"] or len(tokenizer) != self.index["vocab_size"]:
                raise DataError(
                    f"{self.path / INDEX_NAME}: shards were made with tokenizer {self.index['tokenizer_hash']} "
                    f"(vocab {self.index['vocab_size']}), but the given tokenizer is {h} (vocab {len(tokenizer)})"
                )
        self.dtype = np.dtype(self.index["dtype"])
        info = self.index["splits"][split]
        self.maps: list[np.memmap] = []
        for sh in info["shards"]:
            f = self.path / sh["file"]
            if not f.is_file():
                raise DataError(f"{f}: shard listed in {INDEX_NAME} is missing")
            want = sh["tokens"] * self.dtype.itemsize
            if f.stat().st_size != want:
                raise DataError(
                    f"{f}: {f.stat().st_size} bytes, but {INDEX_NAME} says {sh['tokens']} tokens "
                    f"({want} bytes); the shard is truncated or from another run"
                )
            self.maps.append(np.memmap(f, dtype=self.dtype, mode="r"))
        self.num_tokens = int(info["tokens"])
        if self.num_tokens == 0:
            raise DataError(
                f"{self.path}: the {split} split has no tokens (val_fraction "
                f"{self.index['val_fraction']} of {self.index['documents_consumed']} documents)"
            )
        self.num_documents = int(info["documents"])
        self.bytes_per_token = float(info["bytes_per_token"])
        self.vocab_size = int(self.index["vocab_size"])
        self.bos_id = int(self.index["bos_id"])
        self._starts = np.cumsum([0] + [len(m) for m in self.maps])

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, split={self.split!r}, tokens={self.num_tokens}, "
            f"shards={len(self.maps)}, bytes_per_token={self.bytes_per_token:.3f})"
        )

    def tokens(self, start: int, n: int) -> np.ndarray:
        """``n`` consecutive tokens from global position ``start`` (crossing shard boundaries)."""
        out = np.empty(n, dtype=np.int64)
        got = 0
        s = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start - int(self._starts[s])
        while got < n:
            m = self.maps[s]
            take = min(n - got, len(m) - pos)
            out[got : got + take] = m[pos : pos + take]
            got += take
            s, pos = s + 1, 0
        return out

    def _check_len(self, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"seq_len={seq_len!r} must be a positive int")
        if self.num_tokens < seq_len + 1:
            raise DataError(
                f"{self.path}: the {self.split} split has {self.num_tokens} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}; use a shorter sequence or more data"
            )

    def sample_batch(
        self, batch_size: int, seq_len: int, generator: Optional[torch.Generator] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: ``x`` = tokens ``[s, s + seq_len)``, ``y`` = ``[s + 1, s + seq_len + 1)``,
        int64 tensors ``(batch_size, seq_len)``; ``generator`` makes the draw reproducible (per rank)."""
        self._check_len(seq_len)
        starts = torch.randint(0, self.num_tokens - seq_len, (batch_size,), generator=generator)
        t = torch.from_numpy(np.stack([self.tokens(int(s), seq_len + 1) for s in starts]))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def iter_batches(
        self, batch_size: int, seq_len: int, max_batches: Optional[int] = None, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic windows for evaluation: window ``j`` starts at ``j * seq_len``, so every token but the first
        is predicted once (the last partial batch comes smaller, the last partial window is dropped); each
        ``rank`` gets every ``world_size``-th batch, ``max_batches`` (over all ranks) at most."""
        self._check_len(seq_len)
        n_windows = (self.num_tokens - 1) // seq_len
        n_batches = math.ceil(n_windows / batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        for b in range(rank, n_batches, world_size):
            js = range(b * batch_size, min((b + 1) * batch_size, n_windows))
            t = torch.from_numpy(np.stack([self.tokens(j * seq_len, seq_len + 1) for j in js]))
            yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


def tokenizer_hash(tokenizer: Any) -> str:
    """A short sha256 of the tokenizer's canonical JSON (vocabulary, merges, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    data = json.loads(backend.to_str())
    data.pop("post_processor", None)  # how BOS is added to tokenizer(text) does not change the ids
    data.pop("truncation", None)
    data.pop("padding", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
