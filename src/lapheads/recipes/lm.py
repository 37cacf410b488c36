"""NanoChat-style language-model pretraining with k Laplacian heads (the paper's experiment 2; docs/recipe-lm.md).

``lapheads train lm --config tiny --out runs/lm_tiny --set model.laplacian_heads=2``
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .. import transformers as lap_tf
from ..data import shards as S
from ..data import text as T
from ..data.shards import TokenShards
from ..engine import TrainConfig
from ..engine import dist as D
from ..engine.config import ConfigModel, Float, Int, Str, run_rule, to_dict
from ..engine.data import _mix
from ..engine.dist import DistInfo
from ..engine.fsdp import lockstep, transformer_blocks
from ..errors import CheckpointError, ConfigError, DataError
from ..lm.attention import apply_variant
from ..lm.model import (
    LMModelConfig,
    LMOptimConfig,
    budget_params,
    budget_steps,
    build_model,
    build_optimizers,
    count_params,
    muon_momentum,
)
from ..lm.tokenizer import load_tokenizer, stop_token_ids, tokenizer_hash, train_tokenizer
from .base import HeadsTask, LoadedRun, Metric, Recipe, with_ema

__all__ = [
    "LMDataConfig",
    "SampleConfig",
    "LMConfig",
    "LMTask",
    "load_model",
    "token_bytes",
    "prepare_data",
    "bits_per_byte",
    "LMRecipe",
    "RECIPE",
]

DEFAULT_PROMPTS = ["The capital of France is", "The meaning of the word", "def fibonacci(n):", "In Python, a list"]


class LMDataConfig(ConfigModel):
    """Where the tokens come from and how they are batched (the ``data:`` section)."""

    shards: Optional[Str] = Field(
        None, description="directory from `lapheads data tokenize` (then tokenizer must be a DIR)"
    )
    corpus: Any = Field(
        "embedded",
        description='used without shards: "embedded", a file path, a list of paths, '
        'or "hf:PATH_OR_NAME" (a Hugging Face dataset: save_to_disk '
        "directory, parquet/JSON files or a Hub name)",
    )
    text_field: Str = Field("text", description="JSONL key / parquet column / the text column of an hf: corpus")
    hf_split: Str = Field("train", description="hf: corpus: the split read (validation is data.val_fraction of it)")
    hf_name: Str = Field("", description="hf: corpus: the dataset's configuration (subset) name; empty = its default")
    streaming: bool = Field(
        False,
        description="hf: corpus: stream the rows instead of loading the dataset (corpora larger than memory or disk)",
    )
    tokenizer: Str = Field("train", description='DIR of `lapheads tokenizer train`, or "train" (on the corpus)')
    vocab_size: Int = Field(2048, ge=1, description="with tokenizer: train, its vocabulary size")
    tokenizer_max_chars: Int = Field(
        0, ge=0, description="with tokenizer: train, read at most this many characters (0 = all)"
    )
    val_fraction: Float = Field(
        0.05, gt=0.0, lt=1.0, description="documents (or tokens) held out, when the shards are built here"
    )
    val_by: Literal["documents", "tokens"] = Field(
        "documents",
        description="hold out whole documents, or the last val_fraction of every document's tokens (one file works)",
    )
    split_documents: Any = Field(
        None, description='cut each corpus document: "blank_lines", "chapters" or N characters per piece'
    )
    fraction: Float = Field(
        1.0, gt=0.0, le=1.0, description="share of the training documents used (validation stays whole)"
    )
    max_items: Int = Field(0, ge=0, description="cap on training documents after `fraction` (0 = no cap)")
    cache_dir: Optional[Str] = Field(None, description="on-the-fly tokenizer/shards; default ~/.cache/lapheads/lm")
    seq_len: Int = Field(2048, ge=1, description="tokens per training sequence")
    batch_size: Int = Field(32, ge=1, description="sequences per process and micro-step")
    total_batch_tokens: Int = Field(
        0, ge=0, description="tokens per optimizer step over all ranks; 0 = batch_size*seq_len*world*grad_accum"
    )
    tokens_per_param: Float = Field(
        20.0, gt=0.0, description="run length when train.max_steps is 0 (nanochat / Chinchilla: 20)"
    )
    budget_params: Literal["all", "scaling"] = Field(
        "all",
        description="the parameters tokens_per_param counts: all, or scaling = the blocks and lm_head "
        "(nanochat since 2026, which leaves out the token and value embeddings)",
    )
    eval_tokens: Int = Field(
        2**20, ge=1, description="validation tokens per evaluation (fewer if the split is smaller)"
    )
    eval_batch_size: Int = Field(0, ge=0, description="sequences per evaluation batch; 0 = batch_size")


class SampleConfig(ConfigModel):
    """Greedy continuations logged at every evaluation (``samples.jsonl``)."""

    prompts: list[Str] = Field(list(DEFAULT_PROMPTS), description="the prompts continued")
    max_new_tokens: Int = Field(32, ge=0, description="tokens per continuation; 0 = no samples")


class LMConfig(ConfigModel):
    """The ``lm`` recipe."""

    model: LMModelConfig = Field(LMModelConfig(), description="the NanoChat model")
    optim: LMOptimConfig = Field(LMOptimConfig(), description="Muon + AdamW (nanochat)")
    data: LMDataConfig = Field(LMDataConfig(), description="tokens and batches")
    samples: SampleConfig = Field(SampleConfig(), description="greedy samples at every evaluation")
    train: TrainConfig = Field(
        TrainConfig(
            schedule="wsd",
            warmup_ratio=0.0,
            warmdown_ratio=0.2,
            min_lr_ratio=0.0,
            clip_grad=1.0,
            eval_every=250,
            log_every=10,
        ),
        description="the shared engine",
    )

    @run_rule
    def _grad_accum(self) -> None:
        resolve_grad_accum(self.data, self.train, int(os.environ.get("WORLD_SIZE", "1")))

    def resume_mutable(self) -> set[str]:
        """Keys a ``--resume`` may change: ``train.grad_accum`` with ``data.total_batch_tokens`` (it follows
        the world size, so a sharded checkpoint resumes on another number of processes)."""
        return {"train.grad_accum"} if self.data.total_batch_tokens else set()


def resolve_grad_accum(d: LMDataConfig, t: TrainConfig, world_size: int) -> None:
    """Derive ``t.grad_accum`` from ``d.total_batch_tokens`` (in place), nanochat's rule.

    Raises:
        ConfigError: the total is not a multiple of one micro-step over all ranks, or it
            contradicts an explicit ``train.grad_accum``.
    """
    if not d.total_batch_tokens:
        return
    micro = d.batch_size * d.seq_len * world_size
    if d.total_batch_tokens % micro:
        raise ConfigError(
            f"data.total_batch_tokens={d.total_batch_tokens} is not a multiple of one micro-step "
            f"(data.batch_size {d.batch_size} x data.seq_len {d.seq_len} x {world_size} process(es) "
            f"= {micro} tokens)"
        )
    accum = d.total_batch_tokens // micro
    if t.grad_accum not in (1, accum):
        raise ConfigError(
            f"train.grad_accum={t.grad_accum} contradicts data.total_batch_tokens="
            f"{d.total_batch_tokens}, which needs grad_accum={accum}; set only one of them"
        )
    t.grad_accum = accum


def token_bytes(tokenizer: Any) -> torch.Tensor:
    """UTF-8 byte length of every token id (0 for special tokens), as nanochat's ``token_bytes``."""
    special = set(tokenizer.all_special_ids)
    toks = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([0 if i in special or t is None else len(t) for i, t in enumerate(toks)], dtype=torch.int64)


def bits_per_byte(nats: float, nbytes: int) -> float:
    """Summed token losses (nats) over the bytes they encode -> bits per byte."""
    return nats / (math.log(2) * nbytes) if nbytes > 0 else float("nan")


def _corpus_paths(corpus: Any) -> Optional[list[str]]:
    if corpus is None or corpus == "embedded":
        return None
    if isinstance(corpus, str):
        return [corpus]
    if isinstance(corpus, (list, tuple)) and corpus and all(isinstance(c, str) for c in corpus):
        return list(corpus)
    raise ConfigError(f"data.corpus={corpus!r} must be 'embedded', a file path or a non-empty list of paths")


def _corpus_fingerprint(paths: Optional[list[str]]) -> Any:
    if paths is None:
        return {"embedded": "pydoc_data.topics", "python": sys.version.split()[0]}
    stats = [(p, Path(p).stat()) for p in paths]
    return [[str(Path(p).resolve()), st.st_size, st.st_mtime_ns] for p, st in stats]


def _documents(d: LMDataConfig, paths: Optional[list[str]], hf: Any, source: str):
    if hf is not None:  # (source, dataset) of an hf: corpus
        docs = T.read_hf_dataset(hf[1], d.text_field, source)
    else:
        docs = T.embedded_documents() if paths is None else T.iter_documents(paths, text_field=d.text_field)
    return T.split_documents(docs, d.split_documents, source)


def _hf_corpus(d: LMDataConfig) -> Optional[tuple[str, Any]]:
    """``(source, dataset)`` of an ``hf:`` corpus (its text column checked), else None."""
    source = T.hf_source(d.corpus)
    if source is None:
        return None
    ds = T.open_hf_dataset(source, d.hf_split, d.hf_name or None, streaming=d.streaming, what="data.corpus")
    T.check_hf_column(ds, d.text_field, f"data.corpus={d.corpus}", "data.text_field")
    return source, ds


# How `train lm` spells the options that fix a corpus without training text (named in DataError).
_LM_HINTS = {
    "val_fraction": "data.val_fraction",
    "val_by": "data.val_by: tokens",
    "split_documents": "data.split_documents: blank_lines|chapters|N",
    "fraction": "data.fraction",
}


def prepare_data(d: LMDataConfig, info: Optional[DistInfo] = None, progress: bool = False) -> tuple[Any, Path]:
    """Resolve ``data`` to ``(tokenizer, shard_dir)``, building what is missing (rank 0 only).

    Raises:
        ConfigError / DataError: before any expensive work, for a missing path, an empty corpus,
            a shard directory without a tokenizer, or shards made with another tokenizer.
    """
    info = info or DistInfo()
    built_here = {
        k: getattr(d, k)
        for k in ("val_by", "split_documents", "fraction", "max_items")
        if getattr(d, k) != LMDataConfig.model_fields[k].default
    }
    if d.shards is not None:
        if built_here:
            raise ConfigError(
                f"data.{next(iter(built_here))} applies when the shards are built from data.corpus, not to "
                f"data.shards={d.shards}; give the split options to `lapheads data tokenize`"
            )
        if d.tokenizer == "train":
            raise ConfigError(
                f"data.shards={d.shards} needs data.tokenizer set to the tokenizer DIR the shards "
                "were made with (not 'train')"
            )
        tok = load_tokenizer(d.tokenizer)
        S.TokenShards(d.shards, "train", tokenizer=tok)  # raises on a tokenizer/shard mismatch
        return tok, Path(d.shards)
    T.check_split_mode(d.split_documents, "data.split_documents")
    hf = _hf_corpus(d)  # an hf: corpus: opened, its text column checked
    paths = None if hf is not None else _corpus_paths(d.corpus)
    if paths is not None:
        T.check_inputs(paths, text_field=d.text_field)  # missing / empty files, wrong columns
    given_tok = None if d.tokenizer == "train" else load_tokenizer(d.tokenizer)
    corpus = (
        T.hf_fingerprint(hf[0], hf[1], d.hf_name or None, d.hf_split) if hf is not None else _corpus_fingerprint(paths)
    )
    source = f"hf:{hf[0]}" if hf is not None else "pydoc_data.topics" if paths is None else ", ".join(paths)
    key = {
        "corpus": corpus,
        "text_field": d.text_field,
        "val_fraction": d.val_fraction,
        "tokenizer": tokenizer_hash(given_tok)
        if given_tok is not None
        else {"train": d.vocab_size, "max_chars": d.tokenizer_max_chars},
        **built_here,  # settings added later enter the key only when set: existing caches keep their names
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(d.cache_dir or Path(os.environ.get("LAPHEADS_CACHE", Path.home() / ".cache" / "lapheads")) / "lm")
    target = root / digest
    if info.is_main and not (target / "done.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=root))
        try:
            tok = given_tok
            if tok is None:
                docs = _documents(d, paths, hf, source)
                docs = T.limit_chars(docs, d.tokenizer_max_chars) if d.tokenizer_max_chars else docs
                tok = train_tokenizer(docs, d.vocab_size, tmp / "tokenizer")
            S.tokenize_to_shards(
                _documents(d, paths, hf, source),
                tok,
                tmp / "shards",
                val_fraction=d.val_fraction,
                val_by=d.val_by,
                train_fraction=d.fraction,
                max_train_documents=d.max_items,
                hints=_LM_HINTS,
                source=source,
                progress=progress,
            )
            (tmp / "done.json").write_text(json.dumps(key, indent=1))
            if target.exists():  # a stale, unfinished build
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    D.barrier()
    tok = given_tok if given_tok is not None else load_tokenizer(target / "tokenizer")
    return tok, target / "shards"


def open_token_shards(shard_dir: Path, seq_len: int) -> tuple[Any, Any]:
    """The train and val :class:`TokenShards` of ``shard_dir``, each checked to hold at least one
    sequence of ``seq_len + 1`` tokens (input plus shifted target)."""
    shards = (TokenShards(shard_dir, "train"), TokenShards(shard_dir, "val"))
    for s in shards:
        if len(s) < seq_len + 1:
            raise DataError(
                f"{s.path}: the {s.split} split has {len(s)} tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1}; lower data.seq_len or give more text"
            )
    return shards


class TextTask(HeadsTask):
    """What the language tasks share: a transformers causal LM (FSDP over its decoder layers), batches
    seeded by ``(seed, rank, micro step)`` and ``final/hf`` (+ ``hf_ema``) as ``save_pretrained`` directories."""

    model: nn.Module
    tokenizer: Any

    def fsdp_blocks(self) -> list[nn.Module]:
        return transformer_blocks(self.model)  # the decoder layers

    def generators(self, start_micro_step: int) -> Iterator[torch.Generator]:
        """The generator of every micro step from ``start_micro_step`` on (a pure function of the step: exact resume)."""
        for micro in itertools.count(start_micro_step):
            yield torch.Generator().manual_seed(_mix(self.cfg.train.seed, self.info.rank, micro))

    def export_final(self, final_dir: Path, model: nn.Module, ema_model: Optional[nn.Module]) -> None:
        export_hf(model, self.tokenizer, final_dir / "hf")
        if ema_model is not None:
            export_hf(ema_model, self.tokenizer, final_dir / "hf_ema")


class LMTask(TextTask):
    """Pretraining as an engine :class:`~lapheads.engine.TrainTask` (docs/design/recipes.md)."""

    name = "lm"

    def __init__(self, cfg: LMConfig, info: DistInfo, run_dir: Optional[str | Path] = None):
        self.cfg, self.info = cfg, info
        self.run_dir = Path(run_dir) if run_dir is not None else None
        resolve_grad_accum(cfg.data, cfg.train, info.world_size)  # also when built without load_config
        self.open_data()
        d = cfg.data
        vocab = len(self.tokenizer)
        if self.train_shards.vocab_size != vocab:
            raise DataError(
                f"{self.shard_dir}: shards have vocabulary {self.train_shards.vocab_size}, the tokenizer {vocab}"
            )
        stops = stop_token_ids(self.tokenizer)
        self.model = build_model(
            cfg.model,
            vocab,
            d.seq_len,
            device=info.device,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=stops,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        self.n_params = count_params(self.model)

    def open_data(self, check: Callable[[Any], None] = lambda tokenizer: None) -> None:
        """The tokenizer (``check``-ed), the token shards and the validation settings of ``cfg.data``."""
        d, info = self.cfg.data, self.info
        self.tokenizer, self.shard_dir = prepare_data(d, info, progress=self.cfg.train.progress and info.is_main)
        check(self.tokenizer)
        self.train_shards, self.val_shards = open_token_shards(self.shard_dir, d.seq_len)
        self.token_bytes = token_bytes(self.tokenizer).to(info.device)
        self.eval_bs = d.eval_batch_size or d.batch_size
        self.eval_batches = max(1, d.eval_tokens // (self.eval_bs * d.seq_len))
        self._muon = None

    def optimizers(self) -> list[torch.optim.Optimizer]:
        opts = build_optimizers(self.model, self.cfg.optim)
        self._muon = opts[1]
        return opts

    def total_batch_tokens(self) -> int:
        d = self.cfg.data
        return d.batch_size * d.seq_len * self.info.world_size * self.cfg.train.grad_accum

    def total_steps(self) -> int:
        d = self.cfg.data
        return budget_steps(budget_params(self.model, d.budget_params), d.tokens_per_param, self.total_batch_tokens())

    def on_step_start(self, step: int, total: int) -> None:
        if self._muon is not None:  # nanochat's momentum warm-up: a pure function of the step
            m = muon_momentum(step, self.cfg.optim)
            for g in self._muon.param_groups:
                g["momentum"] = m

    def batches(self, start_micro_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        d = self.cfg.data
        for g in self.generators(start_micro_step):
            yield self.train_shards.sample_batch(d.batch_size, d.seq_len, generator=g)

    def loss(self, model: nn.Module, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = (t.to(self.info.device, non_blocking=True) for t in batch)
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        return loss, {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, float]:
        res = with_ema(self.val_bpb, model, ema_model)
        if self.info.is_main or self.sharded:  # a sharded generate() needs every rank (same greedy tokens)
            self.write_samples(model, step)
        return res

    def val_bpb(self, model: nn.Module) -> dict[str, float]:
        """Bits per byte and mean token loss over the fixed validation windows."""
        d = self.cfg.data
        dev = self.info.device
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # nats (byte-bearing), bytes, tokens
        loss_all = torch.zeros((), dtype=torch.float64, device=dev)
        autocast = (
            torch.autocast(dev.type, dtype=torch.bfloat16)
            if dev.type == "cuda" and self.cfg.train.precision != "fp32" and torch.cuda.is_bf16_supported()
            else contextlib.nullcontext()
        )
        batches = self.val_shards.iter_batches(
            self.eval_bs, d.seq_len, max_batches=self.eval_batches, rank=self.info.rank, world_size=self.info.world_size
        )
        first = lambda: next(self.val_shards.iter_batches(self.eval_bs, d.seq_len, max_batches=1))  # noqa: E731
        for (x, y), real in lockstep(batches, first, dev, self.sharded):
            x, y = x.to(dev), y.to(dev)
            with autocast:
                logits = model(input_ids=x, use_cache=False).logits
            if not real:  # a sharded model's forward in lock step with the ranks that still have batches
                continue
            nats = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="none")
            nb = self.token_bytes[y.view(-1)]
            sums[0] += (nats * (nb > 0)).double().sum()
            sums[1] += nb.double().sum()
            sums[2] += y.numel()
            loss_all += nats.double().sum()
        if self.info.distributed:
            torch.distributed.all_reduce(sums)
            torch.distributed.all_reduce(loss_all)
        return {
            "val_bpb": bits_per_byte(float(sums[0]), int(sums[1])),
            "val_loss": float(loss_all / sums[2].clamp(min=1)),
            "val_tokens": int(sums[2]),
        }

    def write_samples(self, model: nn.Module, step: int) -> list[dict]:
        """Greedy continuations of the configured prompts, appended to ``RUN/samples.jsonl``."""
        recs = sample_prompts(model, self.tokenizer, self.cfg.samples.prompts, self.cfg.samples.max_new_tokens)
        if self.run_dir is not None and recs and self.info.is_main:
            with open(self.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
                f.write("".join(json.dumps({"step": step, **r}) + "\n" for r in recs))
        return recs

    def model_spec(self) -> dict:
        return {
            "model": to_dict(self.cfg.model),
            "vocab_size": len(self.tokenizer),
            "max_seq_len": self.cfg.data.seq_len,
            "n_params": self.n_params,
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "laplacian_heads": self.model.config.laplacian_heads,
        }


@torch.no_grad()
def sample_prompts(model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int) -> list[dict]:
    """Greedy continuation of each prompt (one at a time: no padding, KV-cached ``generate``)."""
    if not prompts or max_new_tokens <= 0:
        return []
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt")["input_ids"].to(dev)  # BOS-prefixed, as in pretraining
        gen = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=False)
        out.append({"prompt": p, "completion": text})
    model.train(was_training)
    return out


def export_hf(model: nn.Module, tokenizer: Any, out: Path) -> None:
    """``save_pretrained`` of the model (its config keeps ``laplacian_heads``) and the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def hf_dir(run_dir: str | Path, weights: str = "model") -> Path:
    """``RUN/final/hf`` (or ``hf_ema``) of a finished lm/sft run, or a ``save_pretrained`` directory itself.

    Raises:
        CheckpointError: neither exists.
    """
    p = Path(run_dir)
    if (p / "config.json").is_file():
        return p
    d = p / "final" / ("hf" if weights == "model" else "hf_ema")
    if not (d / "config.json").is_file():
        raise CheckpointError(
            f"{d} does not exist; is {p} a finished `lapheads train lm` / `train sft` run "
            f"(or a save_pretrained directory)?"
        )
    return d


def load_model(run_dir: str | Path, weights: str = "model", device: Any = "cpu", eager: bool = False):
    """``(model, tokenizer)`` of a finished lm/sft run (from ``final/hf``), Laplacian heads restored.

    Args:
        run_dir: the run directory, or a ``save_pretrained`` directory.
        weights: ``"model"`` or ``"ema"`` (when the run kept an EMA).
        device: where to load the model.
        eager: use the eager attention implementation (returns the operator as attentions).
    """
    d = hf_dir(run_dir, weights)
    tok = load_tokenizer(d)
    model = lap_tf.from_pretrained(str(d), eager=eager).to(device).eval()
    apply_variant(model, str(d))  # another attention (xsa) recorded in config.json
    if model.config.vocab_size != len(tok):
        raise CheckpointError(f"{d}: the model has vocabulary {model.config.vocab_size}, its tokenizer {len(tok)}")
    return model, tok


class LMRecipe(Recipe):
    name = "lm"
    config_type = LMConfig
    task_type = LMTask
    kind = "hf"
    metrics = (Metric("val_bpb", "val bits/byte", False), Metric("val_loss", "val loss", False))
    description = (
        "NanoChat-style pretraining (Muon + AdamW, warm-up/stable/warm-down, "
        "validation bits per byte) with k Laplacian heads per layer."
    )

    def text_config(self, run: LoadedRun) -> LMDataConfig:
        """The data config whose validation text measures a run (SFT: that of its pretraining run)."""
        return run.config.data

    def load_run(self, run_dir: str | Path, weights: str = "model", device: Any = "cpu") -> LoadedRun:
        cfg = self.read_config(run_dir)
        model, tok = load_model(run_dir, weights=weights, device=device)
        return self.loaded(run_dir, cfg, model, tokenizer=tok, analyze_options={"num_classes": model.config.vocab_size})

    def eval_batches(self, run: LoadedRun, *, max_items: int, batch_size: int, seq_len: Optional[int] = None) -> list:
        """Windows of the validation token shards (a sequence is a window; a token's class is its next token)."""
        data = self.text_config(run)
        _, shard_dir = prepare_data(data)
        length = seq_len or data.seq_len
        max_pos = int(getattr(run.model.config, "max_position_embeddings", 0) or 0)
        if max_pos and length > max_pos:
            raise ConfigError(f"--seq-len {length} is longer than the model's {max_pos} positions")
        val = TokenShards(shard_dir, "val")
        n_batches = max(1, max_items // batch_size)
        return [
            {"input_ids": x, "attention_mask": torch.ones_like(x)}
            for x, _y in val.iter_batches(batch_size, length, max_batches=n_batches)
        ]


RECIPE = LMRecipe()
