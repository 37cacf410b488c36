"""The attention variants of :mod:`lapheads.variants` in the NanoChat LM (``model.attention`` of the lm recipe).

``xsa`` is transformers' SDPA attention followed by :func:`lapheads.variants.xsa`, registered in
transformers' ``AttentionInterface`` as :data:`XSA_IMPLEMENTATION`; :func:`apply_variant` sets it
again on a loaded model. ``diff`` is not offered for the LM (``docs/design/lm.md`` says why).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import CheckpointError, ConfigError
from ..variants import check_attention, xsa

__all__ = ["XSA_IMPLEMENTATION", "CONFIG_KEY", "check_lm_attention", "set_variant", "apply_variant"]

#: The registered attention implementation of exclusive self-attention.
XSA_IMPLEMENTATION = "lapheads_xsa"
#: The attribute of the model config (and key of ``config.json``) that names the variant.
CONFIG_KEY = "lapheads_attention"


def xsa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, then ``y - (y . v_hat) v_hat`` with each query's own value.

    The queries are the last ``T_q`` positions of the keys (a KV cache holds the earlier ones), so
    a query's own value is ``value[..., T_kv - T_q + i, :]``.
    """
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # (B, T, H, D)
    v_self = value[..., value.shape[-2] - query.shape[-2] :, :]
    return xsa(out.transpose(1, 2), v_self).transpose(1, 2), None


AttentionInterface.register(XSA_IMPLEMENTATION, xsa_attention_forward)
AttentionMaskInterface.register(XSA_IMPLEMENTATION, sdpa_mask)


def check_lm_attention(attention: str, laplacian_heads: Any) -> None:
    """:func:`lapheads.variants.check_attention` plus the LM's own limit (no ``diff``)."""
    check_attention(attention, laplacian_heads)
    if attention == "diff":
        raise ConfigError(
            "model.attention='diff' is offered by the classify recipe only (timm's DiffAttention): "
            "transformers' DiffLlama attention cannot replace NanoChat's without also dropping its QK-norm "
            "(docs/heads.md); use laplacian, standard or xsa"
        )


def set_variant(model: torch.nn.Module, attention: str) -> None:
    """Make ``model`` (a transformers model) use ``attention`` and record it in its config."""
    if attention == "xsa":
        model.set_attn_implementation(XSA_IMPLEMENTATION)
        # transformers reads config.json's "attn_implementation" but never writes it: stored as a plain
        # attribute it is saved, so a plain load needs this module imported (the name registered
        # here) and is refused by transformers without it, instead of building standard attention.
        model.config.attn_implementation = XSA_IMPLEMENTATION
    if attention != "laplacian":
        setattr(model.config, CONFIG_KEY, attention)


def apply_variant(model: torch.nn.Module, source: str = "") -> str:
    """Set the attention recorded in a loaded model's config (``lapheads_attention``) again; returns it.

    Raises:
        CheckpointError: the config names an attention this version cannot build.
    """
    attention = getattr(model.config, CONFIG_KEY, None) or "laplacian"
    if attention not in ("laplacian", "standard", "xsa"):
        raise CheckpointError(
            f"{source or 'the model'}: config.json has {CONFIG_KEY}={attention!r}, which this version of "
            "lapheads cannot build for a language model (laplacian, standard or xsa)"
        )
    set_variant(model, attention)
    return str(attention)
