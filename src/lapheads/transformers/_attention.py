"""The attention functions and mask functions registered in transformers' interfaces (design: docs/architecture.md)."""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ..errors import ConfigError
from ..heads import HeadMix, LayerHeads
from ..ops import causal_lower_right_mask, laplacian_attention, laplacian_attention_reference, mask_like
from ._configs import any_laplacian, config_spec
from ._extras import Extras, additive, fused_extras
from ._indexing import is_cross, module_heads_operator
from ._names import ATTN_IMPLEMENTATION, EAGER_ATTN_IMPLEMENTATION, FUSED_ATTN_IMPLEMENTATION, saved_name

_STATIC_HINT = (
    "Laplacian heads subtract the value at the query's own position, which must be the last Tq "
    "positions of the cached values; a static (preallocated) cache returns its whole max-length "
    "buffer, so its tail is empty slots. Use the dynamic cache (generate() default, "
    "cache_implementation='dynamic') or set laplacian_heads=0."
)


def _check_cache_layout(config: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any) -> None:
    """Refuse a cache whose key/value buffer does not end where the queries end (a static cache)."""
    if not any_laplacian(config):
        return
    if isinstance(q_offset, torch.Tensor):
        raise ConfigError(
            f"a static KV cache cannot serve Laplacian heads (laplacian_heads={config_spec(config)!r}). {_STATIC_HINT}"
        )
    # No int(): it would pin torch.export's symbolic lengths to the example's sizes.
    if kv_offset + kv_length != q_offset + q_length:
        raise ConfigError(
            f"the KV cache hands attention {kv_length} key positions (offset {kv_offset}) but the "
            f"queries end at position {int(q_offset) + int(q_length)}: the cache is preallocated "
            f"(static). {_STATIC_HINT}"
        )


# Weak references to the last masks that passed the check. Identity, not equality, matters here
# (tensor == is elementwise), and weak references never keep a mask alive.
_CHECKED_MASKS: list = []


def _check_attention_call(
    module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor]
) -> None:
    """Per-layer guard for calls that bypassed the mask function (user 4D masks, empty static prefill)."""
    tq, tk = query.shape[-2], key.shape[-2]
    if tk == tq:
        return  # no cache, or a fresh prefill: v_self is all of v
    if attention_mask is None:
        # transformers leaves the mask out with Tk > Tq only for (a) one-token decoding with a
        # dynamic cache, and (b) the prefill of an EMPTY static cache (see sdpa_attention_forward).
        if tq > 1:
            raise ConfigError(
                f"{type(module).__name__}: {tq} queries against {tk} keys without a mask "
                f"(an empty static cache). {_STATIC_HINT}"
            )
        return
    if any(r() is attention_mask for r in _CHECKED_MASKS):
        return  # the same mask object is shared by every layer of one forward: check it once
    m = attention_mask
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    # The newest query always sees its own (last) key slot in a cache that ends at the newest
    # token; a preallocated cache's last slot is empty and masked for every row of every batch.
    if not bool(m[..., -1, -1].any()):
        raise ConfigError(
            f"{type(module).__name__}: the newest query cannot see the last of the {tk} key "
            f"slots, so the cache is preallocated (static). {_STATIC_HINT}"
        )
    _CHECKED_MASKS.append(weakref.ref(attention_mask))
    del _CHECKED_MASKS[:-4]  # full + sliding-window masks of one forward, with room to spare


def _refuse_sparse(module: Any, kwargs: dict) -> None:
    """Refuse sparse key selection handed to the function (DSA), with 0 Laplacian heads too."""
    for name in ("indices", "block_indices"):
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"{type(module).__name__}: sparse attention (`{name}`: each query attends to selected keys) is not "
                "supported by the Laplacian attention implementations; load this model with "
                "attn_implementation='sdpa' or 'eager' (and no Laplacian heads)"
            )


def _extras(module: Any, kwargs: dict) -> Extras:
    """The soft-cap, sinks and position bias of a call; sparse key selection is refused."""
    _refuse_sparse(module, kwargs)
    sinks = next((kwargs[k] for k in ("s_aux", "sinks") if kwargs.get(k) is not None), None)
    return Extras(kwargs.get("softcap"), sinks, kwargs.get("position_bias"))


def _is_causal(module: Any, q_length: int, attention_mask: Optional[torch.Tensor], is_causal: Optional[bool]) -> bool:
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Same rule as transformers' sdpa path: only a multi-token query without a mask needs the flag.
    return bool(q_length > 1 and attention_mask is None and is_causal)


_EAGER_FUNCTIONS: dict[type, Optional[Callable]] = {}


def _eager_function(cls: type) -> Optional[Callable]:
    """``eager_attention_forward`` of the modeling file that defines the module class (or a base)."""
    if cls not in _EAGER_FUNCTIONS:
        fns = (getattr(sys.modules.get(k.__module__), "eager_attention_forward", None) for k in cls.__mro__)
        _EAGER_FUNCTIONS[cls] = next((fn for fn in fns if callable(fn)), None)
    return _EAGER_FUNCTIONS[cls]


def _stock_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float,
    scaling: Optional[float],
    is_causal: Optional[bool],
    kwargs: dict,
) -> tuple[torch.Tensor, Any]:
    """The model's own attention for a layer without Laplacian heads (see ``laplacian_fallback``)."""
    _refuse_sparse(module, kwargs)
    fallback = getattr(module, "laplacian_fallback", None)
    if fallback is None:  # never indexed: what the call itself needs
        extra = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks"))
        fallback = "eager" if extra else "sdpa"
    eager = _eager_function(type(module)) if fallback == "eager" else None
    if eager is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # stock eager adds its mask
        attention_mask = additive(attention_mask, query.dtype, torch.finfo(query.dtype).min)
    if attention_mask is None and _is_causal(module, query.shape[2], None, is_causal):
        causal = causal_lower_right_mask(query.shape[2], key.shape[2], query.device)
        attention_mask = additive(causal, query.dtype, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def laplacian_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Fused attention function registered as :data:`ATTN_IMPLEMENTATION` and :data:`FUSED_ATTN_IMPLEMENTATION`.

    Args:
        module: the calling attention module (indexed by :func:`enable`, or with ``config`` and ``layer_idx``).
        query: ``(B, H, Tq, D)``; key, value: ``(B, H_kv, Tk, D)`` (after the cache update).
        attention_mask: boolean ``(B, 1, Tq, Tk)`` from the registered mask function (float additive
            under :data:`FUSED_ATTN_IMPLEMENTATION`), or None.
        dropout: dropout probability on P.
        scaling: softmax scale.
        is_causal: overrides ``module.is_causal``.
        **kwargs: passed to the stock attention of a layer without Laplacian heads; ``softcap``,
            ``s_aux`` / ``sinks`` and ``position_bias`` are applied.

    Returns:
        ``(out, None)`` with ``out`` of shape ``(B, Tq, H, D)`` as transformers expects.
    """
    h = query.shape[1]
    heads = None if is_cross(module) else module_heads_operator(module, h)
    if heads is None or (isinstance(heads, LayerHeads) and not heads.any):
        return _stock_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    extras = _extras(module, kwargs)
    _check_attention_call(module, query, key, attention_mask)
    causal = _is_causal(module, query.shape[2], attention_mask, is_causal)
    attention_mask = mask_like(attention_mask, query)
    if extras.any:
        out = fused_extras(query, key, value, heads, attention_mask, causal, scaling, dropout, extras)
    else:
        out = laplacian_attention(
            query,
            key,
            value,
            laplacian_heads=heads,
            attn_mask=attention_mask,
            is_causal=causal,
            scale=scaling,
            dropout_p=dropout,
            enable_gqa=key.shape[1] != h,
        )
    return out.transpose(1, 2).contiguous(), None


def laplacian_eager_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention function registered as :data:`EAGER_ATTN_IMPLEMENTATION`.

    Same arguments as :func:`laplacian_sdpa_attention_forward`; ``attention_mask`` is the additive
    float mask of transformers' ``eager_mask``.

    Returns:
        ``(out, operator)``: ``out`` ``(B, Tq, H, D)`` and the ``(B, H, Tq, Tk)`` matrix each head applied
        to V (``P`` or ``I - P``), which transformers returns as the attentions (``output_attentions=True``).
    """
    h = query.shape[1]
    if is_cross(module):  # standard attention: the model's own eager function (it returns P), else the reference
        eager = _eager_function(type(module))
        if eager is not None:
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        heads: Any = LayerHeads((False,) * int(h))
    else:
        heads = module_heads_operator(module, h)
    extras = _extras(module, kwargs)
    if isinstance(heads, HeadMix) or heads.any:
        _check_attention_call(module, query, key, attention_mask)
    causal = _is_causal(module, query.shape[2], attention_mask, is_causal)
    attention_mask = mask_like(attention_mask, query)
    out, op = laplacian_attention_reference(
        query,
        key,
        value,
        laplacian_heads=heads,
        attn_mask=attention_mask,
        is_causal=causal,
        scale=scaling,
        dropout_p=dropout,
        enable_gqa=key.shape[1] != h,
        softcap=extras.softcap,
        sinks=extras.sinks,
        bias=extras.bias,
    )
    return out.transpose(1, 2).contiguous(), op


def _guarded_mask(mask_function: Callable) -> Callable:
    """transformers' ``mask_function`` plus the static-cache refusal (it sees the cache's sizes)."""

    def mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        _check_mask_call(args, kwargs)
        return mask_function(*args, **kwargs)

    return mask


def _check_mask_call(args: tuple, kwargs: dict) -> None:
    names = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset")
    vals = dict(zip(names, args))
    vals.update({k: kwargs[k] for k in names if k in kwargs})
    config = kwargs.get("config")
    if config is None or "q_length" not in vals or "kv_length" not in vals:
        return
    if "allow_is_bidirectional_skip" in kwargs:
        return  # a bidirectional mask (an encoder, or cross-attention over encoder states): no cache to check
    _check_cache_layout(config, vals["q_length"], vals["kv_length"], vals.get("q_offset", 0), vals.get("kv_offset", 0))


def guarded_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' own ``"sdpa"`` function, which first refuses a module whose config claims Laplacian heads."""
    config = getattr(module, "config", None)
    spec = config_spec(config)
    if spec is not None and spec != 0 and spec != "none" and any_laplacian(config):
        raise ConfigError(
            f"{type(module).__name__} has config.laplacian_heads={spec!r} but runs transformers' stock 'sdpa' "
            "attention, which would silently be the standard model: load it with "
            "lapheads.transformers.from_pretrained(path) (or call lapheads.transformers.enable(model, spec)); "
            "for the standard model on purpose set laplacian_heads=0"
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_implementations() -> None:
    """Register the three implementations under all their names, each with its mask function."""
    sdpa, eager = _guarded_mask(sdpa_mask), _guarded_mask(eager_mask)
    functions = {
        ATTN_IMPLEMENTATION: (laplacian_sdpa_attention_forward, sdpa),
        FUSED_ATTN_IMPLEMENTATION: (laplacian_sdpa_attention_forward, eager),
        EAGER_ATTN_IMPLEMENTATION: (laplacian_eager_attention_forward, eager),
    }
    for base, (attention, mask) in functions.items():
        for name in (base, saved_name(base, False), saved_name(base, True)):
            AttentionInterface.register(name, attention)
            AttentionMaskInterface.register(name, mask)
    # "sdpa" (the default of most models) keeps its stock function behind the check above.
    AttentionInterface.register("sdpa", guarded_sdpa_attention_forward)
