"""NanoChat-architecture language models with k Laplacian heads, and nanochat's optimizers.

transformers' ``NanoChatForCausalLM`` with ``laplacian_heads`` in its config (with value embeddings or sliding
windows: :class:`lapheads.lm.nanochat.LapNanoChatForCausalLM`), shaped by nanochat's depth rule
(:func:`resolve_shape`), initialised (:func:`init_weights`), optimised (:func:`build_optimizers`) and
budgeted (:func:`budget_steps`) as nanochat; the comparison with nanochat's ``gpt.py``: ``docs/design/lm.md``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from pydantic import Field
from torch import nn
from transformers import NanoChatConfig, NanoChatForCausalLM

from .. import transformers as lap_tf
from ..engine.config import Beta, ConfigModel, Float, Int, Str, rule
from ..engine.fsdp import muon_class  # ShardedMuon on FSDP2 shards: orthogonalises whole matrices
from ..errors import ConfigError
from ..heads import is_mix_param, learnable_spec
from ..heads_config import HeadsSetting, heads_field
from ..variants import Attention as VariantName
from .attention import check_lm_attention, set_variant
from .nanochat import (
    SLIDING,
    LapNanoChatConfig,
    LapNanoChatForCausalLM,
    default_short_window,
    value_embedding_layers,
    window_layer_types,
)

__all__ = [
    "LMModelConfig",
    "LMOptimConfig",
    "resolve_shape",
    "build_config",
    "build_model",
    "init_weights",
    "param_groups",
    "build_optimizers",
    "muon_momentum",
    "count_params",
    "budget_params",
    "flops_per_token",
    "budget_steps",
]


class LMModelConfig(ConfigModel):
    """Shape of a NanoChat model (the ``model:`` section of the shipped ``lm/*`` configs)."""

    depth: Int = Field(20, ge=1, description="number of transformer blocks (nanochat's single knob)")
    width: Optional[Int] = Field(None, ge=1, description="model width; default 64 * depth")
    n_heads: Optional[Int] = Field(None, ge=1, description="attention heads; default max(1, ceil(width / 128))")
    n_kv_heads: Optional[Int] = Field(None, ge=1, description="key/value heads; default n_heads (nanochat uses no GQA)")
    head_dim: Optional[Int] = Field(
        None, ge=2, description="width of a head (even: RoPE rotates pairs); default width // n_heads"
    )
    mlp_ratio: Int = Field(4, ge=1, description="MLP width as a multiple of the model width")
    rope_theta: Float = Field(10000.0, gt=0.0, description="RoPE base")
    softcap: Float = Field(15.0, ge=0.0, description="tanh soft-cap of the logits; 0 = none")
    laplacian_heads: HeadsSetting = heads_field()
    attention: VariantName = Field(
        "laplacian",
        description="laplacian (softmax attention with `laplacian_heads`) | standard | xsa (exclusive "
        "self-attention); standard and xsa need laplacian_heads: 0 (diff: classify only, docs/heads.md)",
    )
    vocab_size: Int = Field(0, ge=0, description="0 = the tokenizer's vocabulary size; otherwise it must match it")
    value_embeddings: bool = Field(
        False,
        description="nanochat's value embeddings: every other layer, the last included, adds a token embedding "
        "to its values through a gate per head (docs/recipe-lm.md)",
    )
    window_pattern: Str = Field(
        "L",
        description="attention window per layer, tiled over the layers: L = full context, S = the last "
        "short_window tokens; the last layer is always L (nanochat: SSSL)",
    )
    short_window: Int = Field(
        0, ge=0, description="tokens before the query an S layer sees; 0 = data.seq_len / 4 rounded up to 128"
    )

    @rule
    def _window_pattern(self) -> None:
        window_layer_types(self.window_pattern, self.depth)  # the letters, before any model is built


class LMOptimConfig(ConfigModel):
    """nanochat's optimizer settings (the ``optim:`` section)."""

    matrix_lr: Float = Field(0.02, ge=0.0, description="Muon, hidden matrices of the blocks")
    embedding_lr: Float = Field(0.2, ge=0.0, description="AdamW, token embedding (times (width/768)^-0.5)")
    value_embedding_lr: Float = Field(
        0.1, ge=0.0, description="AdamW, value embeddings (times (width/768)^-0.5); nanochat: embedding_lr / 2"
    )
    unembedding_lr: Float = Field(0.004, ge=0.0, description="AdamW, lm_head (times (width/768)^-0.5)")
    weight_decay: Float = Field(0.0, ge=0.0, description="AdamW and Muon (never on the learnable mixing)")
    mix_lr: Float = Field(
        0.02, ge=0.0, description="AdamW, learnable head mixing a, b (laplacian_heads: learn...), no decay"
    )
    adam_betas: tuple[Beta, Beta] = Field((0.8, 0.95), strict=False, description="AdamW betas")
    adam_eps: Float = Field(1e-10, gt=0.0, description="AdamW epsilon")
    muon_momentum: Float = Field(0.95, ge=0.0, lt=1.0, description="Muon momentum after its warmup")
    muon_momentum_start: Float = Field(
        0.85, ge=0.0, lt=1.0, description="nanochat warms Muon's momentum up from this ..."
    )
    muon_momentum_warmup: Int = Field(300, ge=0, description="... over this many optimizer steps; 0 = constant")
    lr_scale_width: Int = Field(768, ge=1, description="AdamW lrs were tuned at this width")


def resolve_shape(cfg: LMModelConfig) -> dict[str, int]:
    """Width, heads, KV heads and head dim of ``cfg`` under nanochat's depth rule.

    Raises:
        ConfigError: an odd head dim, or heads that do not divide the width / KV heads.
    """
    width = cfg.width if cfg.width is not None else 64 * cfg.depth
    heads = cfg.n_heads if cfg.n_heads is not None else max(1, math.ceil(width / 128))
    if cfg.head_dim is None and width % heads:
        raise ConfigError(
            f"model.width={width} is not divisible by model.n_heads={heads}; "
            "set model.head_dim explicitly or pick a divisible width"
        )
    head_dim = cfg.head_dim if cfg.head_dim is not None else width // heads
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(f"model.head_dim={head_dim} must be an even number >= 2 (RoPE rotates pairs)")
    kv = cfg.n_kv_heads if cfg.n_kv_heads is not None else heads
    if heads % kv:
        raise ConfigError(f"model.n_kv_heads={kv} must divide model.n_heads={heads}")
    return {
        "width": width,
        "n_heads": heads,
        "n_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate": cfg.mlp_ratio * width,
        "depth": cfg.depth,
    }


def architecture(cfg: LMModelConfig, max_seq_len: int) -> dict[str, Any]:
    """The :class:`~lapheads.lm.nanochat.LapNanoChatConfig` keys of ``cfg``'s value embeddings and windows
    (empty when it has neither: the stock NanoChat)."""
    types = window_layer_types(cfg.window_pattern, cfg.depth)
    if not cfg.value_embeddings and SLIDING not in types:
        return {}
    window = cfg.short_window or default_short_window(max_seq_len)
    return {
        "value_embedding_layers": value_embedding_layers(cfg.depth) if cfg.value_embeddings else [],
        "layer_types": types,
        "sliding_window": window + 1 if SLIDING in types else None,  # transformers counts the query itself
    }


def config_class(cfg: LMModelConfig, max_seq_len: int) -> type:
    """``NanoChatConfig``, or :class:`~lapheads.lm.nanochat.LapNanoChatConfig` for value embeddings / windows."""
    return LapNanoChatConfig if architecture(cfg, max_seq_len) else NanoChatConfig


def build_config(
    cfg: LMModelConfig, vocab_size: int, max_seq_len: int, *, bos_token_id: int = 0, eos_token_id: Any = None
):
    """A transformers ``NanoChatConfig`` for ``cfg`` with ``laplacian_heads`` set and validated.

    Args:
        cfg: the model section.
        vocab_size: the tokenizer's vocabulary size (``cfg.vocab_size``, when set, must equal it).
        max_seq_len: longest sequence the model will see (RoPE tables, ``max_position_embeddings``).
        bos_token_id / eos_token_id: written to the config for ``generate()``.

    Raises:
        ConfigError: shape errors, a vocabulary mismatch, or Laplacian heads that do not fit.
    """
    if cfg.vocab_size and cfg.vocab_size != vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} does not match the tokenizer's vocabulary of "
            f"{vocab_size} tokens; set model.vocab_size=0 (take it from the tokenizer) or use "
            "the tokenizer the model was made for"
        )
    if vocab_size < 2:
        raise ConfigError(f"vocab_size={vocab_size} must be >= 2")
    if max_seq_len < 1:
        raise ConfigError(f"max_seq_len={max_seq_len} must be >= 1")
    s = resolve_shape(cfg)
    config = config_class(cfg, max_seq_len)(
        vocab_size=vocab_size,
        hidden_size=s["width"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["depth"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=max_seq_len,
        hidden_act="relu2",
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        final_logit_softcapping=float(cfg.softcap) if cfg.softcap else None,
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        **architecture(cfg, max_seq_len),
    )
    try:
        lap_tf.enable(config, cfg.laplacian_heads)
    except ConfigError as e:
        raise ConfigError(
            f"model.laplacian_heads={cfg.laplacian_heads!r} does not fit a model with "
            f"{s['depth']} layers of {s['n_heads']} heads: {e}"
        ) from None
    return config


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """nanochat's initialisation (``docs/design/lm.md``), in place."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, mean=0.0, std=_matrix_std(*mod.weight.shape))
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            nn.init.normal_(mod.weight, mean=0.0, std=1.0)
    # Zero lm_head and residual-branch outputs: the network starts as the identity on the
    # residual stream, and a Laplacian head (like any head) contributes exactly 0 at step 0.
    nn.init.zeros_(model.lm_head.weight)
    for layer in model.model.layers:
        nn.init.zeros_(layer.self_attn.o_proj.weight)
        nn.init.zeros_(layer.mlp.fc2.weight)
        gate = getattr(layer.self_attn, "ve_gate", None)
        if gate is not None:  # nanochat: small positive weights, every gate starts near 3 sigmoid(0) = 1.5
            nn.init.uniform_(gate.weight, 0.0, 0.02)
    v_shape = model.model.layers[0].self_attn.v_proj.weight.shape
    for ve in getattr(model.model, "value_embeds", {}).values():  # the spread of the values they are added to
        nn.init.normal_(ve.weight, mean=0.0, std=_matrix_std(*v_shape))


def _matrix_std(fan_out: int, fan_in: int) -> float:
    """nanochat's init std of a ``(fan_out, fan_in)`` matrix (arXiv 2310.17813)."""
    return 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))


def build_model(
    cfg: LMModelConfig,
    vocab_size: int,
    max_seq_len: int,
    *,
    device: Any = None,
    init: bool = True,
    bos_token_id: int = 0,
    eos_token_id: Any = None,
    pad_token_id: Optional[int] = None,
):
    """Build a ``NanoChatForCausalLM`` with Laplacian heads from ``cfg``.

    Args:
        cfg: the model section.
        vocab_size: the tokenizer's vocabulary size.
        max_seq_len: longest training/inference sequence.
        device: where to put the parameters.
        init: apply :func:`init_weights` (off when weights are loaded next anyway).
        bos_token_id / eos_token_id / pad_token_id: special ids for ``generate()``.
    """
    check_lm_attention(cfg.attention, cfg.laplacian_heads)
    config = build_config(cfg, vocab_size, max_seq_len, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    model = (LapNanoChatForCausalLM if isinstance(config, LapNanoChatConfig) else NanoChatForCausalLM)(config)
    set_variant(model, cfg.attention)
    if learnable_spec(config.laplacian_heads) is not None:
        lap_tf.enable(model, config.laplacian_heads)  # registers lap_mix_a / lap_mix_b per layer
    if init:
        init_weights(model)
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id = bos_token_id, eos_token_id
    first_eos = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    gc.pad_token_id = pad_token_id if pad_token_id is not None else first_eos
    if device is not None:
        model = model.to(device)
    return model


#: where the value embeddings of a :class:`~lapheads.lm.nanochat.LapNanoChatForCausalLM` are
VALUE_EMBEDDING_PREFIX = "model.value_embeds."


def param_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the parameters as nanochat does: ``matrix`` (Muon; the blocks, value-embedding gates included),
    ``embedding``, ``value_embedding``, ``lm_head`` (AdamW), plus ``mix`` (AdamW, no weight decay): the
    learnable head mixing ``lap_mix_a`` / ``lap_mix_b``, vectors that Muon must not take.

    Raises:
        ConfigError: a parameter fits no group or a block parameter is not a 2D matrix (Muon cannot take it).
    """
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {
        "matrix": [],
        "embedding": [],
        "value_embedding": [],
        "lm_head": [],
        "mix": [],
    }
    emb = model.get_input_embeddings().weight
    head = model.lm_head.weight
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p is emb:
            groups["embedding"].append((name, p))
        elif p is head:
            groups["lm_head"].append((name, p))
        elif is_mix_param(name):
            groups["mix"].append((name, p))
        elif name.startswith(VALUE_EMBEDDING_PREFIX):
            groups["value_embedding"].append((name, p))
        elif name.startswith("model.layers."):
            if p.ndim != 2:
                raise ConfigError(
                    f"{name} has shape {tuple(p.shape)}: the blocks must hold only 2D matrices "
                    "(Muon orthogonalises matrices)"
                )
            groups["matrix"].append((name, p))
        else:
            raise ConfigError(f"parameter {name} fits none of nanochat's optimizer groups")
    return groups


def build_optimizers(
    model: nn.Module, cfg: LMOptimConfig, *, fused: Optional[bool] = None
) -> list[torch.optim.Optimizer]:
    """``[AdamW(lm_head, embedding), Muon(block matrices)]`` with nanochat's learning rates.

    Args:
        model: a ``NanoChatForCausalLM``.
        cfg: the optimizer section.
        fused: fused AdamW kernel; default on when the parameters are on a GPU.
    """
    g = param_groups(model)
    width = model.config.hidden_size
    scale = (width / cfg.lr_scale_width) ** -0.5  # AdamW lrs were tuned at width 768
    if fused is None:
        fused = model.lm_head.weight.device.type == "cuda"
    adam_groups = [
        {"params": [p for _, p in g["lm_head"]], "lr": cfg.unembedding_lr * scale, "name": "lm_head"},
        {"params": [p for _, p in g["embedding"]], "lr": cfg.embedding_lr * scale, "name": "embedding"},
    ]
    if g["value_embedding"]:
        adam_groups.append(
            {
                "params": [p for _, p in g["value_embedding"]],
                "lr": cfg.value_embedding_lr * scale,
                "name": "value_embedding",
            }
        )
    if g["mix"]:  # learnable mixing: scalars per head, never weight-decayed
        adam_groups.append({"params": [p for _, p in g["mix"]], "lr": cfg.mix_lr, "name": "mix", "weight_decay": 0.0})
    adamw = torch.optim.AdamW(
        adam_groups, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=fused
    )
    momentum = cfg.muon_momentum_start if cfg.muon_momentum_warmup > 0 else cfg.muon_momentum
    matrices = [p for _, p in g["matrix"]]
    muon = muon_class(matrices)(
        [{"params": matrices, "name": "matrix"}],
        lr=cfg.matrix_lr,
        momentum=momentum,
        nesterov=True,
        weight_decay=cfg.weight_decay,
        adjust_lr_fn="original",
    )
    return [adamw, muon]


def muon_momentum(step: int, cfg: LMOptimConfig) -> float:
    """nanochat's Muon momentum at optimizer step ``step``: linear from start to final over the warm-up."""
    if cfg.muon_momentum_warmup <= 0:
        return cfg.muon_momentum
    frac = min(step / cfg.muon_momentum_warmup, 1.0)
    return (1.0 - frac) * cfg.muon_momentum_start + frac * cfg.muon_momentum


def count_params(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Number of parameters (optionally without the input and value embeddings: lookups, no matmul FLOPs)."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        n -= model.get_input_embeddings().weight.numel()
        n -= sum(p.numel() for name, p in model.named_parameters() if name.startswith(VALUE_EMBEDDING_PREFIX))
    return n


def budget_params(model: nn.Module, which: str = "all") -> int:
    """The parameters a tokens-per-parameter budget counts: ``all``, or ``scaling``, nanochat's count since
    2026 (the blocks' matrices and ``lm_head``; neither token nor value embeddings)."""
    if which == "all":
        return count_params(model)
    if which != "scaling":
        raise ConfigError(f"data.budget_params={which!r} must be all or scaling")
    head = model.lm_head.weight
    blocks = sum(p.numel() for name, p in model.named_parameters() if name.startswith("model.layers."))
    return blocks + head.numel()


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, nanochat's / PaLM's estimate (arXiv 2204.02311, appendix B).

    ``6 * (params - embeddings) + 12 * heads * head_dim * sum over layers of min(window, seq_len)``: forward +
    backward of every matmul weight, plus the attention scores and the weighted sum of values over the keys each
    query sees (``seq_len`` in a full-context layer, at most the window in a sliding one).
    """
    c = model.config
    n = count_params(model, exclude_embedding=True)
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    keys = sum(min(c.sliding_window, seq_len) if t == SLIDING else seq_len for t in types)
    return 6.0 * n + 12.0 * c.num_attention_heads * c.head_dim * keys


def budget_steps(n_params: int, tokens_per_param: float, total_batch_tokens: int) -> int:
    """Optimizer steps for ``tokens_per_param * n_params`` training tokens at ``total_batch_tokens`` per step.

    Raises:
        ConfigError: the budget is smaller than one step.
    """
    if tokens_per_param <= 0 or total_batch_tokens <= 0:
        raise ConfigError(
            f"tokens_per_param={tokens_per_param} and total_batch_tokens={total_batch_tokens} must be > 0"
        )
    target = tokens_per_param * n_params
    steps = int(target // total_batch_tokens)
    if steps < 1:
        raise ConfigError(
            f"the budget of {tokens_per_param} tokens/param x {n_params} params = {target:.0f} tokens "
            f"is less than one step of {total_batch_tokens} tokens; raise tokens_per_param or set "
            "train.max_steps"
        )
    return steps
