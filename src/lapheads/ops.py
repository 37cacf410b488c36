"""The Laplacian attention operator.

:func:`laplacian_attention` is a drop-in for ``F.scaled_dot_product_attention`` (the same shapes,
``(batch, heads, tokens, dim)``, and options) in which the selected heads output ``V - P V``
instead of ``P V``, with ``P = softmax(Q K^T * scale + mask)``. ``laplacian_heads`` takes any head
setting (``3``, ``"all"``, a :class:`lapheads.heads.LayerHeads`, ...) or learnable coefficients
(:class:`lapheads.heads.HeadMix`). :func:`laplacian_attention_reference` is its eager twin: it
builds the explicit operator (``P``, ``I - P`` or ``a I + b P`` per head) and returns it with the
output, for tests and plots. Invalid arguments raise :class:`lapheads.errors.ConfigError`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from . import epilogue
from .errors import ConfigError
from .heads import HeadMix, LayerHeads

__all__ = [
    "laplacian_attention",
    "laplacian_attention_reference",
    "causal_lower_right_mask",
    "masked_softmax",
    "subtract_selected",
]


def mask_like(mask: Optional[torch.Tensor], q: torch.Tensor) -> Optional[torch.Tensor]:
    """A float mask or bias in ``q``'s dtype (SDPA's rule: under autocast q is half, the mask float32)."""
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        return mask.to(q.dtype)
    return mask


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> tuple[int, int]:
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ConfigError(
            f"q, k, v must be (..., heads, seq, dim) tensors of the same rank; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not all(t.is_floating_point() for t in (q, k, v)):
        raise ConfigError(
            f"q, k, v must be floating-point tensors; got dtypes {q.dtype}, {k.dtype}, {v.dtype} "
            "(attention needs real numbers: convert them, e.g. q.float())"
        )
    if not q.dtype == k.dtype == v.dtype and not torch.is_autocast_enabled(q.device.type):
        raise ConfigError(
            f"q, k, v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}: cast them to one "
            "(e.g. k.to(q.dtype)), or run under torch.autocast"
        )
    h, hkv = int(q.shape[-3]), int(k.shape[-3])
    if v.shape[-3] != hkv:
        raise ConfigError(f"k has {hkv} heads but v has {v.shape[-3]}; they must match")
    if k.shape[-2] != v.shape[-2]:
        raise ConfigError(f"k has {k.shape[-2]} positions but v has {v.shape[-2]}; they must match")
    if h != hkv:
        if not enable_gqa:
            raise ConfigError(f"q has {h} heads but k/v have {hkv}; pass enable_gqa=True for grouped-query attention")
        if h % hkv:
            raise ConfigError(f"q heads ({h}) must be a multiple of k/v heads ({hkv}) for grouped-query attention")
    return h, hkv


def _check_mask(attn_mask: Optional[torch.Tensor], q: torch.Tensor, tk: int) -> None:
    """Refuse a mask SDPA would reject (or silently broadcast beyond the output) with a clear error."""
    if attn_mask is None:
        return
    if attn_mask.dtype != torch.bool and not torch.is_floating_point(attn_mask):
        raise ConfigError(f"attn_mask must be boolean (True = attend) or float (additive), got dtype {attn_mask.dtype}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise ConfigError(
            f"a float (additive) attn_mask must have the dtype of q: got mask {attn_mask.dtype}, q {q.dtype}; "
            f"pass attn_mask.to(q.dtype) or a boolean mask"
        )
    target = (*q.shape[:-1], tk)
    if not _broadcasts_to(tuple(attn_mask.shape), target):
        raise ConfigError(
            f"attn_mask has shape {tuple(attn_mask.shape)}, which does not broadcast to (..., H, Tq, Tk) = {target}"
        )


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return bool(torch.broadcast_shapes(shape, target) == torch.Size(target))  # type: ignore[no-untyped-call]
    except RuntimeError:
        return False


def _not_finite(x: Any) -> bool:
    """Not a finite real number (a bool is none)."""
    return isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x)


def _check_numbers(scale: Optional[float], dropout_p: float) -> None:
    """Refuse a ``scale`` or ``dropout_p`` that SDPA would take silently or reject with a misleading message."""
    if scale is not None and (_not_finite(scale) or scale < 0):
        raise ConfigError(f"scale={scale!r} must be None (1/sqrt(head_dim)) or a finite number >= 0")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ConfigError(f"dropout_p={dropout_p!r} must be a number in [0, 1]")


def _check_extras(
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    q: torch.Tensor,
    h: int,
    tk: int,
) -> None:
    """Refuse a soft-cap, sink or position bias that does not fit the call, with the fix."""
    if softcap is not None and (_not_finite(softcap) or softcap <= 0):
        raise ConfigError(f"softcap={softcap!r} must be None (no soft-capping) or a finite number > 0")
    rows = (*q.shape[:-1], 1)
    for name, t, target, hint in (
        ("sinks", sinks, rows, f"({h},) (one per head) or (..., {h}, Tq, 1) (one per head and query)"),
        ("bias", bias, (*q.shape[:-1], tk), "broadcastable to (..., H, Tq, Tk)"),
    ):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ConfigError(f"{name} must be a floating tensor of shape {hint}; got {type(t).__name__}")
        shape = (h, 1, 1) if name == "sinks" and t.dim() == 1 and t.shape[0] == h else tuple(t.shape)
        if not _broadcasts_to(shape, target):
            raise ConfigError(
                f"{name} has shape {tuple(t.shape)}; expected {hint} with (..., H, Tq, Tk) = {(*q.shape[:-1], tk)}"
            )


def _dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """``(..., Tq, 1)`` boolean: True where the mask hides every key of the query row."""
    visible = mask if mask.dtype == torch.bool else mask != float("-inf")
    return ~visible.any(dim=-1, keepdim=True)


def masked_softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax in float32 (float64 stays float64), row maximum subtracted, that gives 0, not NaN, on a row
    that is all ``-inf``; in the dtype of ``scores``."""
    x = scores.to(torch.promote_types(scores.dtype, torch.float32))
    top = x.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    e = torch.exp(x - top)
    total = e.sum(dim=dim, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    return p.to(scores.dtype)


def causal_lower_right_mask(tq: int, tk: int, device: Any = None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True = may attend: query i sees keys ``<= Tk - Tq + i``."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return j <= i + (tk - tq)


def _merge_causal(
    attn_mask: Optional[torch.Tensor], is_causal: bool, tq: int, tk: int, dtype: torch.dtype, device: Any
) -> tuple[Optional[torch.Tensor], bool]:
    """Return (mask, is_causal) to hand to SDPA, turning lower-right causality into a mask."""
    if not is_causal:
        return attn_mask, False
    if attn_mask is None and tq == tk:
        return None, True  # let SDPA use its fused causal path
    causal = causal_lower_right_mask(tq, tk, device)
    if attn_mask is None:
        return causal, False
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal, False
    neg = torch.zeros((), dtype=attn_mask.dtype, device=device).masked_fill(
        torch.ones((), dtype=torch.bool, device=device), float("-inf")
    )
    return attn_mask + torch.where(causal, torch.zeros((), dtype=attn_mask.dtype, device=device), neg), False


def _fused_pv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    dropout_p: float,
    *,
    gqa: bool,
) -> torch.Tensor:
    """``P V`` for every head by one SDPA call (lower-right causality, P = 0 on fully masked rows)."""
    m, causal = _merge_causal(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.dtype, q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=m, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    if m is not None:
        # P = 0 on a fully masked row, whatever SDPA's kernel (or an exporter's decomposition) gives.
        out = out.masked_fill(_dead_rows(m), 0.0)
    return out


def laplacian_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    laplacian_heads: Any,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention where the selected heads output ``V - P V`` instead of ``P V``.

    Args:
        q: queries ``(..., H, Tq, D)``.
        k: keys ``(..., H_kv, Tk, D)``.
        v: values ``(..., H_kv, Tk, Dv)``.
        laplacian_heads: which heads are Laplacian: a :class:`lapheads.heads.LayerHeads` (used as
            is), a boolean ``(H,)`` mask, an int k (trailing k heads), ``"all"``, head indices, ...;
            or a :class:`lapheads.HeadMix` ``(a, b)``: head h applies ``a_h I + b_h P``.
        attn_mask: boolean (True = attend) or additive mask broadcastable to ``(..., H, Tq, Tk)``.
        is_causal: causal masking, aligned to the lower right when ``Tq != Tk``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        dropout_p: dropout on the attention probabilities P (not on the identity term).
        enable_gqa: allow fewer KV heads than query heads (grouped-query attention).

    Returns:
        ``(..., H, Tq, Dv)``, the same as SDPA for standard heads.
    """
    h, hkv, heads = _checked(q, k, v, laplacian_heads, attn_mask, scale, dropout_p, enable_gqa)
    tq, tk = q.shape[-2], k.shape[-2]
    if not heads.any:
        return _fused_pv(q, k, v, attn_mask, is_causal, scale, dropout_p, gqa=h != hkv)
    # v reaches SDPA through a tap, so the gradient through v_self is added into SDPA's dv in place.
    v_sdpa, tape = epilogue.tap(v) if heads.identity else (v, None)
    pv = _fused_pv(q, k, v_sdpa, attn_mask, is_causal, scale, dropout_p, gqa=h != hkv)
    return heads.apply(pv, v[..., tk - tq :, :], tape)


def _checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: Any,
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    dropout_p: float,
    enable_gqa: bool,
) -> tuple[int, int, Union[LayerHeads, HeadMix]]:
    """Every argument check of both functions -> ``(H, H_kv, the head operator)`` (a tensor mask is read back here)."""
    h, hkv = _check_shapes(q, k, v, enable_gqa)
    tq, tk = q.shape[-2], k.shape[-2]
    _check_mask(attn_mask, q, tk)
    _check_numbers(scale, dropout_p)
    if isinstance(spec, HeadMix):
        _check_mix(spec, h)
    heads = spec if isinstance(spec, HeadMix) else LayerHeads.of(spec, h)
    if heads.identity and tq > tk:
        raise ConfigError(
            f"Laplacian heads need every query to have its own position among the keys, but Tq={tq} > Tk={tk}"
        )
    return h, hkv, heads


def subtract_selected(pv: torch.Tensor, v_self: torch.Tensor, heads: LayerHeads) -> torch.Tensor:
    """``v_self - pv`` on the Laplacian heads of ``heads``, ``pv`` on the others: :meth:`LayerHeads.apply`."""
    return heads.apply(pv, v_self)


def _check_mix(mix: HeadMix, h: int) -> None:
    for name, t in (("a", mix.a), ("b", mix.b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != (h,):
            got = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(
                f"HeadMix.{name} must be a floating tensor of shape ({h},) (one per query head); got {got}"
            )


def laplacian_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    laplacian_heads: Any,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`laplacian_attention` that materialises the operator.

    Beyond the arguments of :func:`laplacian_attention`:

    Args:
        softcap: soft-capping (Gemma 2): the scores become ``softcap * tanh(s / softcap)``; > 0.
        sinks: attention sinks, one logit per head ``(H,)`` or broadcastable to ``(..., H, Tq, 1)``:
            an extra key in each row's softmax whose probability is dropped.
        bias: an additive position bias broadcastable to ``(..., H, Tq, Tk)`` (T5-style).

    Returns:
        ``(out, operator)``: ``out`` as the fused function, and the ``(..., H, Tq, Tk)`` matrix applied to
        V per head: ``P``, ``I - P`` (``I`` placing query i at key ``Tk - Tq + i``) or ``a_h I + b_h P``.
    """
    h, hkv, heads = _checked(q, k, v, laplacian_heads, attn_mask, scale, dropout_p, enable_gqa)
    tq, tk = q.shape[-2], k.shape[-2]
    group = h // hkv
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    _check_extras(softcap, sinks, bias, q, h, tk)
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # float32 scores (float64 stays float64): half-precision logits may overflow float16.
    work = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * s
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(work)
    m, _ = _merge_causal(attn_mask, is_causal, tq, tk, q.dtype, q.device)
    if m is None and is_causal:  # tq == tk fused case
        m = causal_lower_right_mask(tq, tk, q.device)
    if m is not None:
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.to(work)
    if sinks is not None:
        # The sink is one more key in every row's softmax; its probability is then dropped.
        col = (sinks.reshape(h, 1, 1) if sinks.dim() == 1 else sinks).to(work)
        col = col.expand(*scores.shape[:-1], 1)
        p = masked_softmax(torch.cat([col, scores], dim=-1), dim=-1)[..., 1:]
    else:
        p = masked_softmax(scores, dim=-1)  # fully masked rows: P = 0, as on the fused path
    if dropout_p > 0:
        p = F.dropout(p, p=dropout_p)
    eye = torch.zeros(tq, tk, dtype=p.dtype, device=p.device)
    if tq <= tk:
        eye[torch.arange(tq), torch.arange(tk - tq, tk)] = 1
    op = heads.operator(p, eye)
    return (op @ v.to(work)).to(q.dtype), op.to(q.dtype)
