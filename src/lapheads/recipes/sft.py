"""Supervised fine-tuning (SFT) of a pretrained NanoChat LM on chat JSONL (the paper's experiment 2; docs/recipe-sft.md).

``lapheads train sft --config tiny --out runs/sft --set init_from=runs/lm_tiny``
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..data.jsonl import iter_jsonl
from ..data.text import is_validation_document
from ..engine import TrainConfig
from ..engine.config import ConfigModel, Float, Int, Str, run_rule
from ..engine.dist import DistInfo
from ..engine.fsdp import lockstep
from ..engine.run import RunDir
from ..errors import ConfigError, DataError
from ..lm.model import LMOptimConfig, build_optimizers, count_params
from ..lm.tokenizer import render_chat, tokenizer_hash
from .base import LoadedRun, Metric, with_ema
from .lm import RECIPE as LM_RECIPE
from .lm import LMDataConfig, LMRecipe, TextTask, load_model

__all__ = [
    "SFTSource",
    "SFTDataConfig",
    "SFTConfig",
    "SFTTask",
    "read_chat_jsonl",
    "read_chat_hf",
    "topics_qa",
    "write_topics_qa",
    "collate_padded",
    "collate_packed",
    "SFTRecipe",
    "RECIPE",
]

EMBEDDED = "embedded"


class SFTSource(ConfigModel):
    """One chat data source (an item of ``data.sources``)."""

    path: Str = Field(
        description='chat JSONL, "embedded" (generated pydoc_data.topics Q/A), or hf:PATH_OR_NAME '
        "(a Hugging Face dataset)"
    )
    weight: Float = Field(1.0, gt=0.0, description="relative over-sampling per conversation")
    column: Str = Field("messages", description="hf: source: the column of message lists ({role, content} dicts)")
    split: Str = Field("train", description="hf: source: the split read")


class SFTDataConfig(ConfigModel):
    """Conversations and batches (the ``data:`` section)."""

    sources: list[SFTSource] = Field(
        [SFTSource(path=EMBEDDED)],
        min_length=1,
        description="chat JSONL sources with mixture weights (at least one; 'embedded' is a generated set)",
    )
    val: list[Str] = Field(
        [], description="validation JSONL files or hf: datasets; empty = val_fraction of each source"
    )
    val_split: Str = Field("test", description="hf: entries of `val`: the split read (column: messages)")
    val_fraction: Float = Field(0.1, ge=0.0, lt=1.0, description="share of each source held out when `val` is empty")
    seq_len: Int = Field(1024, ge=2, description="tokens per row (longer conversations are truncated)")
    batch_size: Int = Field(8, ge=1, description="rows per process and micro-step")
    packing: bool = Field(False, description="several conversations per row (block-diagonal attention)")
    epochs: Float = Field(1.0, gt=0.0, description="run length when train.max_steps is 0")
    max_eval_items: Int = Field(0, ge=0, description="validation conversations per evaluation; 0 = all")


class SFTConfig(ConfigModel):
    """The ``sft`` recipe."""

    init_from: Str = Field("", description="run directory of `lapheads train lm` (or a save_pretrained directory)")
    data: SFTDataConfig = Field(SFTDataConfig(), description="conversations and batches")
    optim: LMOptimConfig = Field(
        LMOptimConfig(muon_momentum_warmup=0), description="Muon + AdamW (nanochat), at lr_scale times these lrs"
    )
    lr_scale: Float = Field(0.02, gt=0.0, description="nanochat's init_lr_frac: SFT lr = lr_scale * pretraining lr")
    train: TrainConfig = Field(
        TrainConfig(schedule="linear", warmup_ratio=0.0, min_lr_ratio=0.0, clip_grad=1.0, eval_every=0, log_every=10),
        description="the shared engine",
    )

    @run_rule
    def _init_from(self) -> None:
        if not self.init_from:
            raise ConfigError(
                "init_from is empty: set it to a finished `lapheads train lm` run directory "
                "(e.g. --set init_from=runs/lm_tiny)"
            )


def topics_qa() -> list[dict]:
    """A small generated chat data set: one Q/A per ``pydoc_data.topics`` topic (sorted by name).

    The answer is the first sentence of the topic's text (whitespace collapsed, at most 300 chars).
    """
    from pydoc_data.topics import topics  # a 0.8 MB module: imported only when the embedded set is used

    out = []
    for name in sorted(topics):
        text = " ".join(topics[name].split())
        m = re.search(r"^(.{20,300}?[.:])(\s|$)", text)
        answer = m.group(1) if m else text[:300]
        q = f"What is the Python documentation topic {name.replace('-', ' ')!r} about?"
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]})
    return out


def write_topics_qa(path: str | Path) -> Path:
    """Write :func:`topics_qa` as chat JSONL (for tests, the quickstart and as a format example)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(c) + "\n" for c in topics_qa()), encoding="utf-8")
    return p


def read_chat_jsonl(path: str | Path) -> list[tuple[int, list[dict]]]:
    """``(line number, messages)`` of every non-blank line of a chat JSONL file.

    Raises:
        DataError: naming ``file:line`` for a missing/empty file, a line that is not JSON, or an
            object without a ``messages`` list.
    """
    p = Path(path)
    out = [(n, _checked_messages(obj.get("messages"), f"{p}:{n}")) for n, obj in iter_jsonl(p, "chat JSONL file")]
    if not out:
        raise DataError(f"{p}: the file holds no conversation (it is empty)")
    return out


def _checked_messages(msgs: Any, where: str, column: str = "messages") -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: expected an object with a non-empty {column!r} list of {{'role', 'content'}} dicts")
    for i, m in enumerate(msgs):  # roles are checked here, before any model is loaded
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant") or "content" not in m:
            raise DataError(
                f"{where}: {column}[{i}] has unknown role {role!r} or no 'content'; allowed "
                "roles: system, user, assistant"
            )
    return msgs


def read_chat_hf(source: str, split: str = "train", column: str = "messages") -> list[tuple[int, list[dict]]]:
    """``(row number from 1, messages)`` of every row of a Hugging Face chat dataset (``hf:`` source).

    Raises:
        DataError: one line for a missing split or column, or a row whose messages are malformed.
    """
    from ..data.text import check_hf_column, open_hf_dataset

    where = f"hf:{source}"
    ds = open_hf_dataset(source, split, what=where)
    check_hf_column(ds, column, where, "column")
    out = [
        (n + 1, _checked_messages(row[column], f"{where}:{split}:{n + 1}", column))
        for n, row in enumerate(ds.select_columns([column]))
    ]
    if not out:
        raise DataError(f"{where}: split {split!r} holds no conversation")
    return out


def _render_all(
    tokenizer: Any, where: str, convs: Sequence[tuple[int, list[dict]]], max_tokens: int
) -> list[tuple[list[int], list[int]]]:
    out = []
    for n, msgs in convs:
        try:
            out.append(render_chat(tokenizer, msgs, max_tokens=max_tokens))
        except DataError as e:
            raise DataError(f"{where}:{n}: {e}") from None
    return out


def _load_source(path: str, split: str = "train", column: str = "messages") -> tuple[str, list[tuple[int, list[dict]]]]:
    if path == EMBEDDED:
        return "embedded(pydoc_data.topics Q/A)", [(i + 1, c["messages"]) for i, c in enumerate(topics_qa())]
    if path.startswith("hf:"):
        return path, read_chat_hf(path[3:].strip(), split, column)
    return path, read_chat_jsonl(path)


def _targets(ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """Inputs ``ids[:-1]`` and labels ``ids[1:]`` with -100 where the target is not an assistant token."""
    return ids[:-1], [t if m else -100 for t, m in zip(ids[1:], mask[1:])]


def collate_padded(convs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """One conversation per row, right-padded; returns input_ids, attention_mask, labels."""
    xs, ys = zip(*[[torch.tensor(t, dtype=torch.long) for t in _targets(ids, m)] for ids, m in convs])
    return {
        "input_ids": pad_sequence(xs, batch_first=True, padding_value=pad_id),
        "attention_mask": pad_sequence([torch.ones_like(x) for x in xs], batch_first=True),
        "labels": pad_sequence(ys, batch_first=True, padding_value=-100),
    }


def collate_packed(
    rows: Sequence[Sequence[tuple[list[int], list[int]]]], row_tokens: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Several whole conversations per row; position ids restart at each (block-diagonal attention).

    Args:
        rows: per row, the conversations it holds (their total length <= ``row_tokens``).
        row_tokens: tokens per row before the input/target shift (``seq_len + 1``).
        pad_id: filler id; the filler is its own "sequence" (positions restart) and has no labels.
    """
    T = row_tokens - 1
    x = torch.full((len(rows), T), pad_id, dtype=torch.long)
    y = torch.full((len(rows), T), -100, dtype=torch.long)
    pos = torch.zeros((len(rows), T), dtype=torch.long)
    for i, convs in enumerate(rows):
        ids = [t for c in convs for t in c[0]]
        mask = [m for c in convs for m in c[1]]
        starts = list(itertools.accumulate(len(c[0]) for c in convs))[:-1]  # where conversations 2, 3, ... start
        xi, yi = _targets(ids, mask)
        n = len(xi)
        x[i, :n] = torch.tensor(xi)
        y[i, :n] = torch.tensor(yi)
        p = torch.arange(T)
        for s in starts + ([n] if n < T else []):  # restart positions at each conversation and the filler
            p[s:] = torch.arange(T - s)
        pos[i] = p
    return {"input_ids": x, "position_ids": pos, "labels": y}


def pack_rows(convs: Sequence[tuple[list[int], list[int]]], row_tokens: int) -> list[list[tuple[list[int], list[int]]]]:
    """Greedy first-fit in order: a conversation that does not fit the current row starts a new one."""
    rows: list[list] = [[]]
    used = 0
    for c in convs:
        if used + len(c[0]) > row_tokens and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(c)
        used += len(c[0])
    return rows


class SFTTask(TextTask):
    """SFT as an engine :class:`~lapheads.engine.TrainTask` (docs/design/recipes.md)."""

    name = "sft"

    def __init__(self, cfg: SFTConfig, info: DistInfo, run_dir: Any = None):
        self.cfg, self.info = cfg, info
        d = cfg.data
        raw = [_load_source(s.path, s.split, s.column) for s in d.sources]
        val_raw = [_load_source(p, d.val_split) for p in d.val]
        self.model, self.tokenizer = load_model(cfg.init_from, device=info.device)
        self.model.train()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        row = d.seq_len + 1
        self.train_sets: list[list[tuple[list[int], list[int]]]] = []
        self.val_set: list[tuple[list[int], list[int]]] = []
        for where, convs in raw:
            rendered = _render_all(self.tokenizer, where, convs, row)
            held = [not d.val and is_validation_document(i, d.val_fraction) for i in range(len(rendered))]
            self.val_set += [c for c, h in zip(rendered, held) if h]
            # nothing to learn without assistant tokens
            train = [c for c, h in zip(rendered, held) if not h and any(c[1][1:])]
            if not train:
                raise DataError(
                    f"{where}: no training conversation with assistant tokens within data.seq_len="
                    f"{d.seq_len} (after holding out val_fraction={d.val_fraction})"
                )
            self.train_sets.append(train)
        for where, convs in val_raw:
            self.val_set += _render_all(self.tokenizer, where, convs, row)
        if d.max_eval_items:
            self.val_set = self.val_set[: d.max_eval_items]
        w = torch.tensor([s.weight * len(t) for s, t in zip(d.sources, self.train_sets)], dtype=torch.float64)
        self.source_probs = w / w.sum()
        self.weighted_convs = float(w.sum())
        self.mean_len = sum(len(c[0]) for t in self.train_sets for c in t) / sum(len(t) for t in self.train_sets)
        self.n_params = count_params(self.model)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        opts = build_optimizers(self.model, self.cfg.optim)
        for o in opts:
            for g in o.param_groups:
                g["lr"] *= self.cfg.lr_scale
        return opts

    def total_steps(self) -> int:
        d = self.cfg.data
        per_row = 1.0 if not d.packing else max(1.0, (d.seq_len + 1) / self.mean_len)
        rows = d.epochs * self.weighted_convs / per_row
        steps = math.ceil(rows / (d.batch_size * self.info.world_size * self.cfg.train.grad_accum))
        if steps < 1:
            raise ConfigError(f"data.epochs={d.epochs} gives no optimizer step; raise it or set train.max_steps")
        return steps

    def _draw(self, g: torch.Generator, n: int) -> list[tuple[list[int], list[int]]]:
        sets = [self.train_sets[s] for s in torch.multinomial(self.source_probs, n, True, generator=g).tolist()]
        return [c[int(torch.randint(len(c), (1,), generator=g))] for c in sets]

    def batches(self, start_micro_step: int) -> Iterator[dict[str, torch.Tensor]]:
        d = self.cfg.data
        for g in self.generators(start_micro_step):
            if not d.packing:
                yield collate_padded(self._draw(g, d.batch_size), self.pad_id)
            else:
                rows: list = []
                while len(rows) < d.batch_size:
                    # draw enough for the remaining rows on average, then keep whole rows only
                    need = d.batch_size - len(rows)
                    k = max(1, math.ceil(need * (d.seq_len + 1) / self.mean_len))
                    packed = pack_rows(self._draw(g, k), d.seq_len + 1)
                    rows += packed[:need] if len(packed) > 1 else packed
                yield collate_packed(rows[: d.batch_size], d.seq_len + 1, self.pad_id)

    def _loss_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.info.device
        b = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        labels = b.pop("labels")
        logits = model(**b, use_cache=False).logits
        nll = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100, reduction="sum"
        )
        return nll, (labels != -100).sum()

    def loss(self, model: nn.Module, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        nll, n = self._loss_sums(model, batch)
        return nll / n.clamp(min=1), {"train_tokens": n.float()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, float]:
        return with_ema(self.val_loss, model, ema_model)

    def val_loss(self, model: nn.Module) -> dict[str, float]:
        """Mean loss (nats) per assistant token over the validation conversations."""
        if not self.val_set:
            return {}
        bs = self.cfg.data.batch_size
        sums = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        starts = range(self.info.rank * bs, len(self.val_set), bs * self.info.world_size)
        for b, real in lockstep(starts, lambda: 0, self.info.device, self.sharded):
            nll, n = self._loss_sums(model, collate_padded(self.val_set[b : b + bs], self.pad_id))
            if not real:  # a sharded model's forward in lock step with the ranks that still have batches
                continue
            sums[0] += nll.double()
            sums[1] += n.double()
        if self.info.distributed:
            torch.distributed.all_reduce(sums)
        return {"val_loss": float(sums[0] / sums[1].clamp(min=1)), "val_tokens": int(sums[1])}

    def model_spec(self) -> dict:
        return {
            "init_from": str(self.cfg.init_from),
            "vocab_size": len(self.tokenizer),
            "n_params": self.n_params,
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "laplacian_heads": getattr(self.model.config, "laplacian_heads", None),
        }


class SFTRecipe(LMRecipe):
    name = "sft"
    config_type = SFTConfig
    task_type = SFTTask
    metrics = (Metric("val_loss", "val loss (assistant tokens)", False),)
    description = (
        "Supervised fine-tuning of a `lapheads train lm` run on chat JSONL "
        "(loss on assistant tokens only, mixture of sources)."
    )

    def heads(self, run_dir: str | Path) -> Any:
        """SFT keeps the heads of the run it started from."""
        base = Path(RunDir(run_dir).read_config().get("init_from") or "")
        return LM_RECIPE.heads(base) if (base / "config.yaml").is_file() else super().heads(run_dir)

    def text_config(self, run: LoadedRun) -> LMDataConfig:
        """Measured on the validation text of the pretraining run it started from."""
        return LM_RECIPE.read_config(run.config.init_from).data


RECIPE = SFTRecipe()
