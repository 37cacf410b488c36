"""Attention variants compared with Laplacian heads: which attention a recipe's model uses.

A recipe's ``model.attention`` picks one of :data:`ATTENTIONS` (the table: docs/heads.md):
``laplacian`` (the heads of ``model.laplacian_heads``), ``standard``, ``diff`` (differential
attention, timm's ``DiffAttention``) or ``xsa`` (exclusive self-attention, :func:`xsa`). The
variants other than ``laplacian`` do not combine with Laplacian heads (:func:`check_attention`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .errors import ConfigError
from .heads import LaplacianHeads

__all__ = ["ATTENTIONS", "Attention", "check_attention", "variant_label", "xsa"]

#: The attention variants a recipe can build (``model.attention``).
ATTENTIONS: tuple[str, ...] = ("laplacian", "standard", "diff", "xsa")
#: The type of a ``model.attention`` config field.
Attention = Literal["laplacian", "standard", "diff", "xsa"]


def check_attention(attention: str, laplacian_heads: Any, key: str = "model") -> None:
    """Refuse a variant that cannot carry the given Laplacian heads.

    Raises:
        ConfigError: ``attention`` is unknown, or is not ``laplacian`` while ``laplacian_heads``
            selects some head (it would be silently ignored).
    """
    if attention not in ATTENTIONS:
        raise ConfigError(f"{key}.attention={attention!r} must be one of {', '.join(ATTENTIONS)}")
    if attention != "laplacian" and not LaplacianHeads(laplacian_heads).is_none():
        raise ConfigError(
            f"{key}.attention={attention!r} replaces every attention layer and has no Laplacian heads, but "
            f"{key}.laplacian_heads={laplacian_heads!r}; set {key}.laplacian_heads=0 (or {key}.attention=laplacian)"
        )


def variant_label(attention: str, heads_label: str) -> str:
    """The label of a run in tables: the head setting's label for softmax attention, else the variant's name."""
    return heads_label if attention in ("laplacian", "standard") else attention


def xsa(y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exclusive self-attention: ``y - (y . v_hat) v_hat`` per head and token, ``v_hat = v / ||v||``.

    Args:
        y: the attention output ``(..., H, T, D)`` (SDPA's ``P V``).
        v: the values ``(..., H_kv, T, D)``, ``H_kv`` dividing ``H`` (grouped-query attention as SDPA).

    Returns:
        ``y`` without its component along each token's own value (a zero value removes nothing).
    """
    h, hkv = y.shape[-3], v.shape[-3]
    if h % hkv:
        raise ConfigError(f"xsa: {h} query heads are not a multiple of {hkv} value heads")
    yg = y.unflatten(-3, (hkv, h // hkv))  # (..., H_kv, G, T, D)
    vh = torch.nn.functional.normalize(v, dim=-1).unsqueeze(-3)  # (..., H_kv, 1, T, D)
    out = yg - (yg * vh).sum(-1, keepdim=True) * vh
    return out.flatten(-4, -3)
