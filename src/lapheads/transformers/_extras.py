"""Soft-capping (Gemma 2), per-head sinks (GPT-OSS) and an additive position bias (T5) on the fused path."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..heads import HeadMix, LayerHeads
from ..ops import (
    _merge_causal,
    causal_lower_right_mask,
    laplacian_attention,
    laplacian_attention_reference,
    masked_softmax,
)


@dataclasses.dataclass
class Extras:
    """What a model's attention call adds to ``softmax(q k^T * scale + mask)``."""

    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None  # (H,) logits, one per query head
    bias: Optional[torch.Tensor] = None  # additive, broadcastable to (B, H, Tq, Tk)

    @property
    def any(self) -> bool:
        return self.softcap is not None or self.sinks is not None or self.bias is not None


def additive(mask: torch.Tensor, dtype: torch.dtype, fill: float) -> torch.Tensor:
    """A boolean mask (True = attend) as an additive float mask (``fill`` where hidden)."""
    return (
        torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, fill)
        if mask.dtype == torch.bool
        else mask.to(dtype)
    )


def flex_softcap_pv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    softcap: float,
) -> torch.Tensor:
    """``P V`` with soft-capped scores by FlexAttention's ``score_mod`` (the mask joins the score_mod)."""
    from torch.nn.attention.flex_attention import flex_attention

    tq, tk = query.shape[2], key.shape[2]
    m = merged_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None and m.dim() == 2:
        m = m.view(1, 1, tq, tk)
    neg = float("-inf")

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        s = torch.tanh(score / softcap) * softcap
        if m is None:
            return s
        bi = b if m.shape[0] > 1 else 0
        hi = h if m.shape[1] > 1 else 0
        if m.dtype == torch.bool:
            return torch.where(m[bi, hi, qi, ki], s, neg)
        return s + m[bi, hi, qi, ki]

    out = flex_attention(
        query, key, value, score_mod=score_mod, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    if m is not None:  # P = 0 on a fully masked row, as everywhere else
        visible = m if m.dtype == torch.bool else m != neg
        out = out.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    return out


def explicit_pv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    dropout: float,
    softcap: float,
) -> torch.Tensor:
    """``P V`` with soft-capped scores materialised in float32 (float64 stays float64), no operator matrix."""
    h, hkv, tq, tk = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
    if tq > tk:
        raise ConfigError(
            f"Laplacian heads need every query to have its own position among the keys, but Tq={tq} > Tk={tk}"
        )
    if h != hkv:
        key = key.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    work = torch.promote_types(query.dtype, torch.float32)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    s = torch.matmul(query.to(work), key.to(work).transpose(-2, -1)).mul_(scale)
    s = torch.tanh(s.div_(softcap)) * softcap  # tanh saves its output for backward: not in place
    m = merged_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None and m.dtype == torch.bool:
        p = masked_softmax(s.masked_fill_(~m, float("-inf")), dim=-1)  # a fully masked row: P = 0
    else:
        p = torch.softmax(s if m is None else s.add_(m.to(work)), dim=-1)
    if dropout > 0:
        p = torch.nn.functional.dropout(p, p=dropout)
    return torch.matmul(p.to(value.dtype), value)


def merged_mask(
    attention_mask: Optional[torch.Tensor], causal: bool, tq: int, tk: int, device: Any
) -> Optional[torch.Tensor]:
    """The call's mask with lower-right causality merged in by the operator's own rule (None: every key visible)."""
    dtype = attention_mask.dtype if attention_mask is not None else torch.bool
    m, still_causal = _merge_causal(attention_mask, causal, tq, tk, dtype, device)
    return causal_lower_right_mask(tq, tk, device) if still_causal else m


def fused_extras(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: Union[LayerHeads, HeadMix],
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    dropout: float,
    extras: Extras,
) -> torch.Tensor:
    """The fused path of a call with soft-cap, sinks or position bias: ``(B, H, Tq, D)`` (see the module)."""
    h, tq, tk = query.shape[1], query.shape[2], key.shape[2]
    gqa = key.shape[1] != h
    if extras.softcap is not None:
        if extras.bias is None and extras.sinks is None:
            # FlexAttention is a fused kernel only inside torch.compile, and CPU lowers no float64.
            flex = dropout == 0.0 and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            if flex and torch.compiler.is_compiling():
                pv = flex_softcap_pv(query, key, value, attention_mask, causal, scaling, extras.softcap)
            else:
                pv = explicit_pv(query, key, value, attention_mask, causal, scaling, dropout, extras.softcap)
            return heads.apply(pv, value[:, :, tk - tq :, :])  # v_self: the last Tq values (GQA broadcasts)
        out, _ = laplacian_attention_reference(
            query,
            key,
            value,
            laplacian_heads=heads,
            attn_mask=attention_mask,
            is_causal=causal,
            scale=scaling,
            dropout_p=dropout,
            enable_gqa=gqa,
            softcap=extras.softcap,
            sinks=extras.sinks,
            bias=extras.bias,
        )
        return out
    # Sinks and bias: one SDPA call with an additive float mask.
    mask = merged_mask(attention_mask, causal, tq, tk, query.device)
    add = None if mask is None else additive(mask, query.dtype, float("-inf"))
    if extras.bias is not None:
        bias = extras.bias.to(query.dtype)
        add = bias if add is None else add + bias
    if extras.sinks is not None:
        key, value = F.pad(key, (0, 0, 1, 0)), F.pad(value, (0, 0, 1, 0))  # a zero key and value in front
        b = query.shape[0]
        base = (add if add is not None else query.new_zeros(1, 1, tq, tk)).expand(b, h, tq, tk)
        # one logit per head (GPT-OSS, shape (H,)) or per head and query (shape (B, H, Tq, 1))
        sinks = extras.sinks.reshape(1, h, 1, 1) if extras.sinks.dim() == 1 else extras.sinks
        add = torch.cat([sinks.to(query.dtype).expand(b, h, tq, 1), base], dim=-1)
    return laplacian_attention(
        query,
        key,
        value,
        laplacian_heads=heads,
        attn_mask=add,
        is_causal=False,
        scale=scaling,
        dropout_p=dropout,
        enable_gqa=gqa,
    )
