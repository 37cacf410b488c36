"""Retrofitting: switch k heads of a pretrained causal LM to Laplacian heads and train briefly (docs/recipe-retrofit.md).

``lapheads train retrofit --config tiny --out runs/retro --set init_from=runs/lm_tiny``

The switch-cost rule, the conversion record, the LoRA wrapper and the baseline run here are shared with
:mod:`lapheads.recipes.retrofit_vit`.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field, ValidationInfo, WithJsonSchema
from torch import nn

from .. import transformers as lap_tf
from ..engine import TrainConfig
from ..engine.config import Beta, ConfigModel, Float, Int, Str, rule, run_rule
from ..engine.dist import DistInfo
from ..engine.run import RunDir
from ..errors import ConfigError, DataError
from ..heads import LaplacianHeads, is_count
from ..heads_config import HEADS_JSON_SCHEMA
from ..lm.model import count_params
from ..lm.tokenizer import tokenizer_hash
from ..outputs import read_json
from .lm import (
    LMConfig,
    LMDataConfig,
    LMRecipe,
    LMTask,
    SampleConfig,
    export_hf,
    hf_dir,
    resolve_grad_accum,
)
from .lm import load_model as load_lm

__all__ = [
    "LoraSettings",
    "RetrofitOptim",
    "RetrofitConfig",
    "RetrofitTask",
    "switch_cost_table",
    "switch_costs",
    "select_heads",
    "with_lora",
    "load_model",
    "summarize",
    "RetrofitRuns",
    "RetrofitRecipe",
    "RECIPE",
]

KEEP = "keep"


class LoraSettings(ConfigModel):
    """PEFT ``LoraConfig`` settings (``method: lora``)."""

    r: Int = Field(8, ge=1, description="rank of the adapters")
    alpha: Float = Field(16.0, gt=0.0, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: Float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    target_modules: list[Str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], description="last names of the modules that get adapters"
    )


class RetrofitOptim(ConfigModel):
    """AdamW over the trained parameters (all of them, or the LoRA adapters)."""

    lr: Float = Field(3e-4, ge=0.0, description="learning rate")
    weight_decay: Float = Field(0.0, ge=0.0, description="weight decay of the matrices")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), strict=False, description="AdamW betas")


def retrofit_heads(value: Any, info: ValidationInfo) -> Any:
    """Field check of a retrofit's ``laplacian_heads``: ``keep`` or a head setting (its shape is checked
    against the model when it loads)."""
    if value != KEEP:
        LaplacianHeads(value, name=info.field_name or "laplacian_heads")  # a malformed spec fails here
    return value


#: a retrofit's ``laplacian_heads``: a head setting, or ``keep`` (convert nothing, the baseline)
RetrofitHeads = Annotated[
    Any,
    AfterValidator(retrofit_heads),
    WithJsonSchema(
        {
            "title": "head setting or keep",
            "anyOf": [{"const": KEEP, "description": "convert nothing (the baseline)"}, *HEADS_JSON_SCHEMA["anyOf"]],
        }
    ),
]

RETROFIT_HEADS_HELP = 'int k, per-layer list, per-layer index lists, or "keep" (no conversion)'
SELECT_HELP = "how an int k picks heads: the trailing k, or the k of least switch cost (see the module docstring)"


class RetrofitBase(ConfigModel):
    """The keys every retrofit config starts with (a subclass may redefine one; it keeps its place)."""

    init_from: Str = Field("", description="a `lapheads train lm`/`sft` run or a save_pretrained directory")
    laplacian_heads: RetrofitHeads = Field(2, description=RETROFIT_HEADS_HELP)
    select: Literal["trailing", "score"] = Field("trailing", description=SELECT_HELP)
    score_batches: Int = Field(2, ge=1, description="validation batches of the switch-cost score")
    method: Literal["full", "lora"] = Field("full", description="train every weight, or LoRA adapters only")
    lora: LoraSettings = Field(LoraSettings(), description="PEFT LoRA settings (method: lora)")

    @rule
    def _select(self) -> None:
        if self.select == "score" and not is_count(self.laplacian_heads):
            raise ConfigError(
                f"select: score picks k heads per layer and needs an int laplacian_heads, got "
                f"{self.laplacian_heads!r}; give explicit heads with select: trailing"
            )


def check_steps(train: TrainConfig) -> None:
    """``train.max_steps`` is the N of a retrofit's comparison: it must be set."""
    if train.max_steps < 1:
        raise ConfigError("train.max_steps must be set (>= 1): it is the N of the before / after N steps comparison")


class RetrofitConfig(RetrofitBase):
    """The ``retrofit`` recipe."""

    optim: RetrofitOptim = Field(RetrofitOptim(), description="AdamW")
    baseline: bool = Field(True, description="also fine-tune the unconverted model for the same steps (OUT/baseline)")
    data: LMDataConfig = Field(
        LMDataConfig(seq_len=512, batch_size=8, eval_tokens=2**16),
        description="tokens and batches (the tokenizer is init_from's)",
    )
    samples: SampleConfig = Field(SampleConfig(max_new_tokens=0), description="greedy samples at every evaluation")
    train: TrainConfig = Field(
        TrainConfig(schedule="cosine", warmup_ratio=0.05, min_lr_ratio=0.1, clip_grad=1.0, eval_every=0, log_every=10),
        description="the shared engine (train.max_steps is the N of the comparison)",
    )

    @run_rule
    def _run(self) -> None:
        if not self.init_from:
            raise ConfigError(
                "init_from is empty: set it to a pretrained run or save_pretrained directory "
                "(e.g. --set init_from=runs/lm_tiny)"
            )
        hf = hf_dir(self.init_from)  # CheckpointError when it is neither
        if self.data.tokenizer == "train":  # the model's own tokenizer, never a new one
            self.data.tokenizer = str(hf)
        if self.data.shards is None and self.data.tokenizer != str(hf):
            raise ConfigError(
                f"data.tokenizer={self.data.tokenizer} is not the tokenizer of init_from ({hf}); "
                "leave it unset to tokenize the corpus with the model's tokenizer"
            )
        check_steps(self.train)
        # derived here, as for `train lm`, so that --resume compares the resolved value
        resolve_grad_accum(self.data, self.train, int(os.environ.get("WORLD_SIZE", "1")))

    resume_mutable = LMConfig.resume_mutable


@torch.no_grad()
def mean_loss(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], forward: Callable = nn.Module.__call__
) -> float:
    """Mean cross-entropy of the logits ``forward(model, x)`` against ``y`` over ``batches``."""
    tot, n = 0.0, 0
    dev = next(model.parameters()).device
    for x, y in batches:
        logits = forward(model, x.to(dev)).float()
        tot += float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.to(dev).view(-1), reduction="sum"))
        n += y.numel()
    return tot / max(1, n)


def switch_cost_table(heads_per_layer: Sequence[int], loss: Callable[[list[list[int]]], float]) -> list[list[float]]:
    """The switch-cost rule: ``costs[i][h] = loss(only head h of layer i Laplacian) - loss(no Laplacian head)``.

    Args:
        heads_per_layer: the number of heads of each layer.
        loss: the validation loss of the model with the given selection (per-layer head-index lists)
            in place of its own; called once per head, plus once for the reference.
    """
    n_layers = len(heads_per_layer)
    ref = loss([[] for _ in range(n_layers)])
    return [
        [loss([[h] if i == layer else [] for i in range(n_layers)]) - ref for h in range(n_heads)]
        for layer, n_heads in enumerate(heads_per_layer)
    ]


@torch.no_grad()
def switch_costs(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[float]]:
    """Per layer and head: validation loss with only that head Laplacian minus the unconverted loss.

    ``model.config.laplacian_heads`` is restored afterwards. One forward pass over ``batches`` per
    head (plus one for the reference).
    """
    cfg = model.config
    n_layers, n_heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    old, old_impl = getattr(cfg, "laplacian_heads", None), cfg._attn_implementation
    was_training = model.training
    model.eval()

    def loss(selection: list[list[int]]) -> float:
        cfg.laplacian_heads = selection
        return mean_loss(model, batches, lambda m, x: m(input_ids=x, use_cache=False).logits)

    try:
        lap_tf.enable(model, 0)
        costs = switch_cost_table([n_heads] * n_layers, loss)
    finally:
        cfg.laplacian_heads = old
        model.set_attn_implementation(old_impl)
        model.train(was_training)
    return costs


def select_heads(costs: list[list[float]], k: int) -> list[list[int]]:
    """The ``k`` heads of lowest switch cost in each layer (ties: the higher index, i.e. trailing first)."""
    for i, row in enumerate(costs):
        if k > len(row):
            raise ConfigError(f"laplacian_heads={k} but layer {i} has {len(row)} heads")
    return [sorted(sorted(range(len(row)), key=lambda h: (row[h], -h))[:k]) for row in costs]


def convert_heads(
    task: Any, model: nn.Module, measure: Callable, costs: Callable[[], list], switch: Callable[[Any], Any]
) -> None:
    """Measure ``model`` (``task.before``), switch its heads as ``task.cfg`` says (``switch(spec)`` returns the
    heads' JSON form; ``costs()`` the switch costs for ``select: score``), measure again (``task.converted``).
    ``keep`` switches nothing."""
    cfg = task.cfg
    task.before, task.switch_costs = measure(model), None
    if cfg.laplacian_heads == KEEP:
        task.heads, task.converted = task.original_heads, dict(task.before)
        return
    spec: Any = cfg.laplacian_heads
    if cfg.select == "score":
        task.switch_costs = costs()
        spec = select_heads(task.switch_costs, int(spec))
    task.heads = switch(spec)
    task.converted = measure(model)


def retrofit_record(task: Any) -> dict[str, Any]:
    """What a retrofit task adds to ``final/model.json`` (what :func:`summarize` and the heads rule read)."""
    c = task.cfg
    return {
        "init_from": str(c.init_from),
        "method": c.method,
        "original_laplacian_heads": task.original_heads,
        "laplacian_heads": task.heads,
        "select": c.select,
        "switch_costs": task.switch_costs,
        "n_params": task.n_params,
        "n_trainable": task.n_trainable,
        "before": task.before,
        "converted": task.converted,
    }


class RetrofitTask(LMTask):
    """Convert (maybe), then continue pretraining (docs/design/recipes.md)."""

    name = "retrofit"

    def __init__(self, cfg: RetrofitConfig, info: DistInfo, run_dir: Optional[str | Path] = None):
        self.cfg, self.info = cfg, info  # type: ignore[assignment]
        self.run_dir = Path(run_dir) if run_dir is not None else None
        d = cfg.data
        resolve_grad_accum(d, cfg.train, info.world_size)
        model, _ = load_lm(cfg.init_from, device=info.device)
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos is not None and d.seq_len > int(max_pos):
            raise ConfigError(f"data.seq_len={d.seq_len} exceeds the model's max_position_embeddings={max_pos}")

        def check(tok: Any) -> None:
            if len(tok) != model.config.vocab_size:
                raise DataError(f"{d.tokenizer}: vocabulary {len(tok)} != the model's {model.config.vocab_size}")

        def switch(spec: Any) -> Any:
            lap_tf.enable(model, spec)
            return model.config.laplacian_heads

        self.open_data(check)
        self.original_heads = getattr(model.config, "laplacian_heads", None)
        model.eval()
        with torch.no_grad():
            batches = self.val_shards.iter_batches(self.eval_bs, d.seq_len, max_batches=cfg.score_batches)
            convert_heads(self, model, self.val_bpb, lambda: switch_costs(model, list(batches)), switch)
        if cfg.method == "lora":
            model = with_lora(model, cfg.lora, task_type="CAUSAL_LM")
        model.train()
        self.model = model
        self.n_params = count_params(model)
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        o = self.cfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        rest = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}] + (
            [{"params": rest, "weight_decay": 0.0}] if rest else []
        )
        return [torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas))]

    def total_steps(self) -> int:
        raise ConfigError("set train.max_steps (the N of the retrofit comparison)")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, float]:
        res = super().evaluate(model, ema_model, step)
        res.update({f"before_{k}": v for k, v in self.before.items() if k != "val_tokens"})
        res.update({f"converted_{k}": v for k, v in self.converted.items() if k != "val_tokens"})
        return res

    def model_spec(self) -> dict:
        return {
            **retrofit_record(self),
            "vocab_size": len(self.tokenizer),
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
        }

    def export_final(self, final_dir: Path, model: nn.Module, ema_model: Optional[nn.Module]) -> None:
        if self.cfg.method == "lora":
            model.save_pretrained(str(final_dir / "adapter"))  # the adapter alone (PEFT layout)
            export_hf(copy.deepcopy(model).merge_and_unload(), self.tokenizer, final_dir / "hf")
            if ema_model is not None:
                export_hf(copy.deepcopy(ema_model).merge_and_unload(), self.tokenizer, final_dir / "hf_ema")
        else:
            super().export_final(final_dir, model, ema_model)


def with_lora(
    model: nn.Module, s: LoraSettings, task_type: Optional[str] = None, linear_only: bool = False
) -> nn.Module:
    """``model`` wrapped with PEFT LoRA adapters on the modules whose last name is in ``s.target_modules``.

    Args:
        task_type: PEFT's ``task_type`` (``"CAUSAL_LM"``; ``None`` for a plain module such as a timm ViT).
        linear_only: adapt only ``nn.Linear`` modules of those names, given to PEFT by full name (timm
            calls both the attention output and the patch-embedding convolution ``proj``).
    """
    try:
        from peft import LoraConfig, get_peft_model  # optional dependency (the eval extra)
    except ImportError:
        raise ConfigError("method: lora needs PEFT; pip install 'lapheads[eval]' (or pip install peft)") from None
    modules = [(n, m) for n, m in model.named_modules() if not linear_only or isinstance(m, nn.Linear)]
    names = {n.rsplit(".", 1)[-1] for n, _ in modules}
    missing = [t for t in s.target_modules if t not in names]
    if missing or not s.target_modules:
        raise ConfigError(
            f"lora.target_modules {missing or s.target_modules} not found in the model; "
            f"its linear layers are named {sorted(n for n in names if n and not n.isdigit())}"
        )
    targets = (
        [n for n, _ in modules if n.rsplit(".", 1)[-1] in s.target_modules] if linear_only else list(s.target_modules)
    )
    cfg = LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=targets, task_type=task_type)
    return get_peft_model(model, cfg)


load_model = load_lm  # a finished retrofit run is read like a pretraining run (final/hf, LoRA merged)


def summarize(out: str | Path, keys: Sequence[str] = ("val_loss", "val_bpb")) -> dict[str, Any]:
    """``OUT/retrofit.json``: before conversion, right after, after N steps, and the baseline after N steps.

    ``keys``: the metrics compared (the LM's validation loss and bits per byte; the ViT's top-1 and loss).
    """
    out = Path(out)
    spec = json.loads((out / "final" / "model.json").read_text())
    final = json.loads((out / "final" / "metrics.json").read_text())
    rows = {"before_conversion": spec["before"], "after_conversion": spec["converted"], "after_steps": final}
    base = out / "baseline" / "final" / "metrics.json"
    if base.is_file():
        rows["baseline_after_steps"] = json.loads(base.read_text())
    rows = {k: {m: v[m] for m in keys if m in v} for k, v in rows.items()}
    keys = ("method", "original_laplacian_heads", "laplacian_heads", "select")
    res = {"steps": spec["step"], **{k: spec[k] for k in keys}, "metrics": rows}
    (out / "retrofit.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    return res


class RetrofitRuns:
    """What every retrofit recipe adds to the recipe of its model (mixed in before it): the heads rule,
    the baseline as a second engine run in ``OUT/baseline``, and ``OUT/retrofit.json``.

    The config needs ``laplacian_heads``, ``select`` and ``baseline``; the task's ``model_spec`` the
    keys :func:`summarize` reads (``before``, ``converted``, ``method``, ``laplacian_heads``, ...).
    """

    #: the metrics of ``retrofit.json`` (keys of the task's evaluation)
    summary_keys: tuple[str, ...] = ("val_loss", "val_bpb")
    #: a retrofit's head setting is a top-level key (the heads it converts, per layer)
    heads_key = "laplacian_heads"

    def heads(self, run_dir: str | Path) -> Any:
        """The heads after conversion (``final/model.json``), else the configured ones."""
        spec = Path(run_dir) / "final" / "model.json"
        if spec.is_file():
            return read_json(spec, "the model description of a retrofit run").get("laplacian_heads")
        return self.configured_heads(RunDir(run_dir).read_config())

    def configured_heads(self, raw: dict) -> Any:
        """The heads of an unfinished run (from its ``config.yaml``, as written)."""
        return raw.get("laplacian_heads", KEEP)

    def train(
        self, cfg: Any, out: str | Path, *, resume: bool = False, overwrite: bool = False, reevaluate: bool = False
    ) -> dict:
        """The retrofit run in ``out``, then (``baseline``) the unconverted model for the same steps in
        ``out/baseline``; returns the comparison (:func:`summarize`)."""
        runs = [(cfg, str(out))]
        if cfg.baseline:
            base = cfg.model_copy(deep=True, update={"laplacian_heads": KEEP, "select": "trailing", "baseline": False})
            runs.append((base, str(Path(out) / "baseline")))
        for i, (c, o) in enumerate(runs):
            # a baseline that never started (the retrofit run was stopped) starts afresh on --resume
            resume_this = resume and (i == 0 or Path(o).exists())
            super().train(c, o, resume=resume_this, overwrite=overwrite, reevaluate=reevaluate)  # type: ignore[misc]
        return summarize(out, self.summary_keys) if int(os.environ.get("RANK", "0")) == 0 else {}

    def final_result(self, out: str | Path) -> dict:
        return summarize(out, self.summary_keys)

    def finished(self, cfg: Any, out: str | Path) -> bool:
        """The retrofit run and, with ``baseline``, its baseline run wrote ``final/``."""
        runs = [Path(out)] + ([Path(out) / "baseline"] if cfg.baseline else [])
        return all(super().finished(cfg, r) for r in runs)  # type: ignore[misc]

    def result_lines(self, result: dict, out: str | Path) -> list[str]:
        lines = [
            f"retrofit to laplacian_heads={result['laplacian_heads']!r} ({result['method']}, {result['steps']} steps):"
        ]
        for name, m in result["metrics"].items():
            lines.append(
                f"  {name:<22} "
                + "  ".join(f"{k}={v:.4f}" for k, v in m.items() if isinstance(v, float) and math.isfinite(v))
            )
        return lines + [f"-> {Path(out) / 'retrofit.json'}"]


class RetrofitRecipe(RetrofitRuns, LMRecipe):
    name = "retrofit"
    config_type = RetrofitConfig
    task_type = RetrofitTask
    kind = "hf"
    description = (
        "Switch k heads of a pretrained causal LM to Laplacian heads and continue training for "
        "train.max_steps (full or LoRA), against fine-tuning the unconverted model for the same "
        "steps (OUT/baseline)."
    )


RECIPE = RetrofitRecipe()
