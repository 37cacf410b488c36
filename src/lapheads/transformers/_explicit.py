"""The explicit forms of the attention call: scores, soft-cap, position bias, mask, sinks, softmax.

What SDPA cannot express (Gemma 2's soft-capping, GPT-OSS's sinks, T5's additive position bias on
the eager path) is computed here with the scores materialised, the way the stock eager functions
of those models compute it. :func:`explicit_attention` builds the operator itself (``P``,
``I - P`` or ``a I + b P`` per head) for the eager implementation; :func:`explicit_pv` and
:func:`flex_softcap_pv` compute only ``P V`` for the fused path, whose heads are then applied by
:func:`apply_heads`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import torch

from ..errors import ConfigError
from ..heads import HeadMix, LayerHeads
from ..ops import causal_lower_right_mask, masked_softmax, subtract_selected


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


def scores_mask(
    attention_mask: Optional[torch.Tensor], causal: bool, tq: int, tk: int, device: Any
) -> Optional[torch.Tensor]:
    """The call's mask, with lower-right causality merged in (None: every key is visible)."""
    if not causal:
        return attention_mask
    c = causal_lower_right_mask(tq, tk, device)
    if attention_mask is None:
        return c
    if attention_mask.dtype == torch.bool:
        return attention_mask & c
    return attention_mask + additive(c, attention_mask.dtype, float("-inf"))


def sink_column(sinks: torch.Tensor, b: int, h: int, tq: int, dtype: torch.dtype) -> torch.Tensor:
    """Sink logits as a ``(B, H, Tq, 1)`` score column: one per head (GPT-OSS, shape ``(H,)``) or
    one per head and query (Inkling 2, ``(B, H, Tq, 1)``)."""
    col = sinks.reshape(1, h, 1, 1) if sinks.dim() == 1 else sinks
    return col.to(dtype).expand(b, h, tq, 1)


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: Union[LayerHeads, HeadMix],
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    dropout: float,
    extras: Extras,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, Tq, D), operator (B, H, Tq, Tk))`` with soft-cap, sinks and bias applied explicitly.

    The scores are ``q k^T * scale``, soft-capped (``cap * tanh(s / cap)``), plus the position
    bias, plus the mask (a boolean mask hides with ``-inf``, a float mask is added); a sink logit
    per head joins each row's softmax and its probability is dropped; the operator is ``P``,
    ``I - P`` or ``a I + b P`` per head, in float32 (float64 stays float64).
    """
    b, h, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if h != hkv:
        key = key.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    identity = isinstance(heads, HeadMix) or heads.any
    if identity and tq > tk:
        raise ConfigError(
            f"Laplacian heads need every query to have its own position among the keys, but Tq={tq} > Tk={tk}"
        )
    work = torch.promote_types(query.dtype, torch.float32)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    s = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale
    if extras.softcap is not None:
        s = torch.tanh(s / extras.softcap) * extras.softcap
    if extras.bias is not None:
        s = s + extras.bias.to(work)
    m = scores_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(work)
    if extras.sinks is not None:
        sink = sink_column(extras.sinks, s.shape[0], h, tq, work)
        p = masked_softmax(torch.cat([sink, s], dim=-1), dim=-1)[..., 1:]
    else:
        p = masked_softmax(s, dim=-1)
    if dropout > 0 and training:
        p = torch.nn.functional.dropout(p, p=dropout)
    eye = torch.zeros(tq, tk, dtype=p.dtype, device=p.device)
    if tq <= tk:
        eye[torch.arange(tq), torch.arange(tk - tq, tk)] = 1
    if isinstance(heads, HeadMix):
        op = heads.a.to(p.dtype).view(h, 1, 1) * eye + heads.b.to(p.dtype).view(h, 1, 1) * p
    else:
        op = torch.where(heads.mask(p.device).view(h, 1, 1), eye - p, p)
    return (op @ value.to(work)).to(query.dtype), op.to(query.dtype)


def flex_usable(query: torch.Tensor, dropout: float) -> bool:
    """FlexAttention is a fused kernel only inside torch.compile, and CPU lowers no float64."""
    return (
        dropout == 0.0
        and torch.compiler.is_compiling()
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
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
    m = scores_mask(attention_mask, causal, tq, tk, query.device)
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


def apply_heads(pv: torch.Tensor, value: torch.Tensor, heads: Union[LayerHeads, HeadMix]) -> torch.Tensor:
    """``P V`` -> the layer's output: ``v_self - P V`` on Laplacian heads (``a v_self + b P V`` when learnable)."""
    h, tq = pv.shape[1], pv.shape[2]
    vs = value[:, :, value.shape[2] - tq :, :]
    if h != value.shape[1]:
        vs = vs.repeat_interleave(h // value.shape[1], dim=1)
    if isinstance(heads, HeadMix):
        return heads.a.to(pv.dtype).view(h, 1, 1) * vs + heads.b.to(pv.dtype).view(h, 1, 1) * pv
    return subtract_selected(pv, vs, heads)


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
    """``P V`` with soft-capped scores, materialised (what stock eager does): no ``I - P`` matrix is built."""
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
    m = scores_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None and m.dtype == torch.bool:
        p = masked_softmax(s.masked_fill_(~m, float("-inf")), dim=-1)  # a fully masked row: P = 0
    else:
        p = torch.softmax(s if m is None else s.add_(m.to(work)), dim=-1)
    if dropout > 0:
        p = torch.nn.functional.dropout(p, p=dropout)
    return torch.matmul(p.to(value.dtype), value)
