"""The attention variants of :mod:`lapheads.variants` in timm ViTs (classify's ``model.attention``):
``"diff"`` is timm's ``DiffAttention``, ``"xsa"`` :class:`XSAAttention` (docs/design/data.md)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from timm.layers import Attention

from ..variants import xsa

__all__ = ["XSAAttention", "attn_layer", "MARKER"]

#: The persistent buffer that marks an XSA layer in a state dict.
MARKER = "xsa"


class XSAAttention(Attention):
    """timm's ``Attention`` whose heads output ``y - (y . v_hat) v_hat`` (``y`` = SDPA's ``P V``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer(MARKER, torch.ones(1, dtype=torch.int8))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        key = prefix + MARKER
        absent = key not in state_dict  # stock timm weights: they load into an XSA layer
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing_keys = args[2]  # args: local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        if absent and key in missing_keys:
            missing_keys.remove(key)

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.0, is_causal=is_causal
        )
        y = xsa(y, v).transpose(1, 2).reshape(B, N, self.attn_dim)
        y = self.norm(y)
        if gate is not None:
            y = y * gate
        return self.proj_drop(self.proj(y))


def attn_layer(attention: str) -> Any:
    """timm's ``attn_layer`` argument of a variant (``diff`` or ``xsa``)."""
    return {"diff": "diff", "xsa": XSAAttention}[attention]
