"""NanoChat as nanochat trains it in 2026: value embeddings and sliding-window layers, on transformers' NanoChat.

transformers' ``NanoChatForCausalLM`` has neither. :class:`LapNanoChatForCausalLM` subclasses it with both, as
options of its config (:class:`LapNanoChatConfig`, ``model_type: lapheads_nanochat``), registered with
transformers' ``AutoConfig`` / ``AutoModelForCausalLM``: ``from_pretrained`` of a saved model builds this class, and
a process that never imported lapheads refuses the model type instead of building a model without them.
:func:`lapheads.lm.model.build_model` uses the stock class when both are off, so those models stay what they were.

- Value embeddings (ResFormer's value residual, as nanochat does it): layers ``n_layers - 1``, ``n_layers - 3``,
  ... (every other layer, the last included) each have a token embedding of the width of the values; it is added
  to the layer's values through a gate per key/value head, ``v += 3 sigmoid(W x[..., :12]) * ve[token]``, ``x`` the
  layer's normalised input. The values the operator sees (and a Laplacian head subtracts) are these mixed values.
- Sliding windows: ``layer_types`` lists ``full_attention`` or ``sliding_attention`` per layer; a sliding layer's
  query sees itself and the ``sliding_window - 1`` tokens before it (transformers' convention). The mask carries the
  window, so the head operator (``V - P V`` for a Laplacian head) applies after the windowed softmax, and
  transformers' ``DynamicCache`` keeps only the window of such a layer (its newest entries are still the queries'
  own values, which is what a Laplacian head needs).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, NanoChatConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.nanochat.modeling_nanochat import (
    NanoChatAttention,
    NanoChatDecoderLayer,
    NanoChatForCausalLM,
    NanoChatModel,
    NanoChatPreTrainedModel,
    NanoChatRMSNorm,
    NanoChatRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ..errors import ConfigError

__all__ = [
    "MODEL_TYPE",
    "FULL",
    "SLIDING",
    "value_embedding_layers",
    "window_layer_types",
    "default_short_window",
    "LapNanoChatConfig",
    "LapNanoChatForCausalLM",
]

#: ``model_type`` of a NanoChat with value embeddings or sliding windows (``config.json``)
MODEL_TYPE = "lapheads_nanochat"
FULL, SLIDING = "full_attention", "sliding_attention"
_PATTERN = {"L": FULL, "S": SLIDING}


def value_embedding_layers(n_layers: int) -> list[int]:
    """The layers with a value embedding: every other layer, the last included (nanochat's ``has_ve``)."""
    return [i for i in range(n_layers) if i % 2 == (n_layers - 1) % 2]


def window_layer_types(pattern: str, n_layers: int) -> list[str]:
    """``pattern`` (``L`` = full context, ``S`` = sliding window) tiled over ``n_layers``; the last layer is always
    full (nanochat's rule). Raises ConfigError for an empty pattern or another letter."""
    p = pattern.upper()
    if not p or set(p) - set(_PATTERN):
        raise ConfigError(
            f"model.window_pattern={pattern!r} must be a non-empty string of L (full context) and S "
            '(sliding window), e.g. "SSSL"'
        )
    types = [_PATTERN[p[i % len(p)]] for i in range(n_layers)]
    types[-1] = FULL
    return types


def default_short_window(seq_len: int) -> int:
    """Tokens before the query that a short-window layer sees, nanochat's rule: a quarter of the context,
    rounded up to a multiple of 128 (FlashAttention-3's tile)."""
    return math.ceil(math.ceil(seq_len / 4) / 128) * 128


class LapNanoChatConfig(NanoChatConfig):
    """``NanoChatConfig`` plus value embeddings and per-layer sliding windows.

    Attributes:
        value_embedding_layers: the layers that have a value embedding (empty: none).
        value_embedding_gate_channels: input channels the gate reads (nanochat: the first 12).
        value_embedding_gate_scale: the gate's range ``(0, scale)`` (nanochat: 3).
        layer_types: ``full_attention`` / ``sliding_attention`` per layer (None: all full).
        sliding_window: keys a sliding layer's query sees, itself included (transformers' convention).
    """

    model_type = MODEL_TYPE
    value_embedding_layers: list[int] | None = None
    value_embedding_gate_channels: int = 12
    value_embedding_gate_scale: float = 3.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [FULL] * n
        if self.value_embedding_layers is None:
            self.value_embedding_layers = []
        super().__post_init__(**kwargs)
        self.check()

    def check(self) -> None:
        """Raise ConfigError when the per-layer settings do not fit the model."""
        n = self.num_hidden_layers
        types, ve = list(self.layer_types or []), list(self.value_embedding_layers or [])
        if len(types) != n or set(types) - {FULL, SLIDING}:
            raise ConfigError(f"layer_types={types!r} must hold {n} entries, each {FULL!r} or {SLIDING!r}")
        if SLIDING in types and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(f"sliding_window={self.sliding_window!r} must be a positive int with sliding layers")
        if any(not 0 <= i < n for i in ve) or len(set(ve)) != len(ve):
            raise ConfigError(f"value_embedding_layers={ve!r} must be distinct layer indices in 0..{n - 1}")
        if ve and not 1 <= self.value_embedding_gate_channels <= self.hidden_size:
            raise ConfigError(
                f"value_embedding_gate_channels={self.value_embedding_gate_channels} must be in 1..{self.hidden_size}"
            )


class LapNanoChatAttention(NanoChatAttention):
    """NanoChat attention with the layer's sliding window and, in a value-embedding layer, the gated value mix."""

    def __init__(self, config: LapNanoChatConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        types = config.layer_types or []
        self.sliding_window = config.sliding_window if types[layer_idx] == SLIDING else None
        has_ve = layer_idx in (config.value_embedding_layers or [])
        channels = config.value_embedding_gate_channels
        self.ve_gate = nn.Linear(channels, int(config.num_key_value_heads or 0), bias=False) if has_ve else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Any = None,
        value_embedding: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.ve_gate is not None:
            if value_embedding is None:
                raise ConfigError(
                    f"layer {self.layer_idx} has a value embedding but was called without one: call the "
                    "model with input_ids (a value embedding is looked up by token, not computed from embeddings)"
                )
            c = self.config
            gate = c.value_embedding_gate_scale * torch.sigmoid(
                self.ve_gate(hidden_states[..., : c.value_embedding_gate_channels])
            )  # (B, T, H_kv)
            v = v + gate.transpose(1, 2).unsqueeze(-1) * value_embedding.view(hidden_shape).transpose(1, 2)
        assert position_embeddings is not None  # the model computes them once for every layer
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = self.q_norm(q), self.k_norm(k)  # NanoChat: RoPE, then QK-norm
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,  # the mask already holds it; flash kernels read it here
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


class LapNanoChatDecoderLayer(NanoChatDecoderLayer):
    """NanoChat's block with :class:`LapNanoChatAttention` (its forward hands ``value_embedding`` on to it)."""

    def __init__(self, config: LapNanoChatConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = LapNanoChatAttention(config, layer_idx)


_RECORD = {"hidden_states": LapNanoChatDecoderLayer, "attentions": LapNanoChatAttention}


class LapNanoChatModel(NanoChatModel):
    """NanoChat's decoder with the value embeddings (``value_embeds``, by layer index) and one mask per layer type."""

    config_class = LapNanoChatConfig
    _no_split_modules = ["LapNanoChatDecoderLayer"]
    _can_record_outputs = _RECORD

    def __init__(self, config: LapNanoChatConfig):
        NanoChatPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LapNanoChatDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = NanoChatRMSNorm(eps=config.rms_norm_eps)
        self.rotary_emb = NanoChatRotaryEmbedding(config=config)
        kv_width = config.num_key_value_heads * config.head_dim
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(config.vocab_size, kv_width) for i in config.value_embedding_layers or []}
        )
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Any = None,
        position_ids: Optional[torch.Tensor] = None,
        cache: Any = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)  # sliding layers keep only their window
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        masks = attention_mask if isinstance(attention_mask, dict) else None  # generate() may build them
        if masks is None:
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": position_ids,
            }
            masks = {FULL: create_causal_mask(**mask_kwargs)}
            if SLIDING in self.config.layer_types:
                masks[SLIDING] = create_sliding_window_causal_mask(**mask_kwargs)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        hidden_states = self.norm(hidden_states)  # NanoChat's norm before the layers
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            ve = self.value_embeds[str(i)] if str(i) in self.value_embeds else None
            if ve is not None and input_ids is None:
                raise ConfigError(
                    "a NanoChat with value embeddings looks them up by token: call it with input_ids, not inputs_embeds"
                )
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[self.config.layer_types[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                value_embedding=None if ve is None else ve(input_ids).to(hidden_states.dtype),
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


class LapNanoChatForCausalLM(NanoChatForCausalLM):
    """``NanoChatForCausalLM`` over :class:`LapNanoChatModel` (its forward: the stock one)."""

    config_class = LapNanoChatConfig
    _no_split_modules = ["LapNanoChatDecoderLayer"]
    _can_record_outputs = _RECORD

    def __init__(self, config: LapNanoChatConfig):
        NanoChatPreTrainedModel.__init__(self, config)
        self.model = LapNanoChatModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


AutoConfig.register(MODEL_TYPE, LapNanoChatConfig)
AutoModelForCausalLM.register(LapNanoChatConfig, LapNanoChatForCausalLM)
