"""Laplacian heads in timm models (timm >= 1.0.23, unmodified).

* :func:`create_model` = ``timm.create_model`` + :func:`convert`, for any timm name it converts,
  and the loader of saved Laplacian models (a file, ``local-dir:``, ``hf-hub:``): it takes the
  heads from the checkpoint.
* :func:`convert` turns every convertible attention module of an existing model into its
  Laplacian twin IN PLACE: no parameter is created, copied or re-initialised, so pretrained
  weights, optimizer references and ``state_dict`` keys are unchanged (each converted layer adds
  one marker buffer, ``lap_heads``). It takes per-layer settings; :func:`laplacian_head_counts`
  reads them back and :func:`skipped_attention_layers` lists the layers left standard, with the
  reason. A model none of whose layers converts is refused with a :class:`ConfigError`.
* :class:`LaplacianAttention`, a subclass of ``timm.layers.Attention`` usable as ``attn_layer=``
  of timm's ``VisionTransformer`` / ``Block``; ``LaplacianAttention.with_heads(k)`` carries one
  setting for every layer.
* Registered names for the paper's variants, created by ``timm.create_model`` once
  ``lapheads.timm`` has been imported: ``<timm name>_lap<k>`` is the model with the trailing k
  heads of every layer Laplacian, for ``deit3_small_patch16_224`` (k = 1..6; the paper's
  "ViT-S-5L" is ``_lap5``), ``deit3_base_patch16_224`` (1..12; "ViT-B-12L" is ``_lap12``) and
  ``deit3_large_patch16_224`` (1..16). The baseline is the plain timm name. No weights exist for
  them: to start from DeiT-3 weights use
  ``create_model("deit3_base_patch16_224", pretrained=True, laplacian_heads=12)``.

Converted attention families (:data:`LAPLACIAN_CLASSES`, timm class: the models that use it):

* ``timm.layers.Attention``: ViT, DeiT, DeiT-3, DINOv2, CLIP, SigLIP, NaFlexViT, PiT, MobileViT,
  CrossViT's branches, ...
* ``timm.models.eva.EvaAttention``: EVA, EVA-02, DINOv3 (``vit_*_dinov3``), timm's RoPE ViTs
  (``vit_*_rope_reg*_gap_256``): RoPE after the prefix tokens, fused or separate q/k/v, q/v biases,
  sub-LN (``norm``), gate.
* ``timm.layers.AttentionRope``: the RoPE-ViTs (``vit_*_patch16_rope[_mixed]_224``, EVA's
  ``attn_type='rope'``), Qwen3 / DeepSeek ViT (grouped-query K/V too).
* ``timm.models.beit.Attention``: BEiT / BEiT v2: q/v biases, (shared) relative position bias.
* ``timm.models.swin_transformer.WindowAttention``: Swin: attention per window, the shifted
  windows' mask, relative position bias.
* ``timm.models.swin_transformer_v2.WindowAttention``: Swin v2: cosine attention with the clamped
  logit scale, continuous position bias (``16 sigmoid(cpb_mlp)``).
* ``timm.models.vision_transformer_relpos.RelPosAttention``: RelPos ViT: ``rel_pos.get_bias()`` or
  the shared bias.
* ``timm.models.hiera.MaskUnitAttention``: Hiera: mask-unit (windowed) and global attention, the
  layers that do not pool their queries.
* ``timm.models.levit.Attention``: LeViT: attention biases, linear or conv layout.
* ``timm.models.maxxvit.Attention2d`` / ``AttentionCl``: MaxViT, CoAtNet, MaxxViT: block / grid
  partitions and 2-d layers, relative position bias.
* ``timm.models.metaformer.Attention``: CAFormer's attention stages.
* ``timm.models.davit.WindowAttention``: DaViT's spatial (window) blocks.

Which timm families pass is measured by the test suite (the timm coverage table of the docs). How
the conversion and the checkpoints work: docs/architecture.md.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, cast

import torch

try:
    import timm
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "lapheads.timm needs timm, which is not installed: pip install timm (or lapheads[train])", name=e.name
    ) from None
import torch.nn.functional as F
from timm.layers import Attention
from timm.layers.attention import AttentionRope
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models.beit import Attention as BeitAttention
from timm.models.davit import WindowAttention as DavitWindowAttention
from timm.models.eva import EvaAttention
from timm.models.hiera import MaskUnitAttention
from timm.models.levit import Attention as LevitAttention
from timm.models.maxxvit import Attention2d as MaxxVitAttention2d
from timm.models.maxxvit import AttentionCl as MaxxVitAttentionCl
from timm.models.metaformer import Attention as MetaFormerAttention
from timm.models.swin_transformer import WindowAttention as SwinWindowAttention
from timm.models.swin_transformer_v2 import WindowAttention as SwinV2WindowAttention
from timm.models.vision_transformer_relpos import RelPosAttention
from torch import nn

from .errors import ConfigError
from .heads import (
    HeadSpec,
    LaplacianHeads,
    LayerHeads,
    laplacianness,
    layer_operator,
    nearer_laplacian,
    set_layer_heads,
)
from .ops import laplacian_attention, laplacian_attention_reference

_L = TypeVar("_L", bound="LaplacianLayer")

__all__ = [
    "LaplacianLayer",
    "LaplacianAttention",
    "LaplacianEvaAttention",
    "LaplacianAttentionRope",
    "LaplacianBeitAttention",
    "LaplacianSwinWindowAttention",
    "LaplacianSwinV2WindowAttention",
    "LaplacianRelPosAttention",
    "LaplacianMaskUnitAttention",
    "LaplacianLevitAttention",
    "LaplacianMaxxVitAttention2d",
    "LaplacianMaxxVitAttentionCl",
    "LaplacianMetaFormerAttention",
    "LaplacianDavitWindowAttention",
    "LAPLACIAN_CLASSES",
    "convert",
    "create_model",
    "laplacian_head_counts",
    "laplacian_attention_layers",
    "skipped_attention_layers",
    "REGISTERED_MODELS",
    "VARIANT_BASES",
]

#: timm base models that get registered ``_lap<k>`` variants, with their number of heads.
VARIANT_BASES: dict[str, int] = {
    "deit3_small_patch16_224": 6,
    "deit3_base_patch16_224": 12,
    "deit3_large_patch16_224": 16,
}

_LAP_NAME = re.compile(r"^(?P<base>.+)_lap(?P<k>\d+)$")

#: timm attention class -> its Laplacian twin (filled by :func:`_converts`).
LAPLACIAN_CLASSES: dict[type, type["LaplacianLayer"]] = {}


#: name of the marker buffer of every converted layer: one int8 per head, the codes below.
MARKER = "lap_heads"
MIX_STANDARD, MIX_LAPLACIAN, MIX_LEARNABLE = 0, 1, 2
#: state-dict keys a stock timm model does not have (the marker, learnable mixing parameters).
_LAPLACIAN_KEY = re.compile(rf"(?:^|\.)(?:{MARKER}|lap_mix_a|lap_mix_b)$")


def describe_codes(codes: list[int]) -> str:
    """A marker's codes in words: ``Laplacian heads [4, 5] of 6``, ``learnable mixing``, ``no Laplacian head``."""
    if codes and all(c == MIX_LEARNABLE for c in codes):
        return f"learnable mixing of {len(codes)} heads"
    lap = [h for h, c in enumerate(codes) if c == MIX_LAPLACIAN]
    return f"Laplacian heads {lap} of {len(codes)}" if lap else f"no Laplacian head of {len(codes)}"


def _converts(stock: type) -> Callable[[type[_L]], type[_L]]:
    """Class decorator: register ``cls`` as the Laplacian twin of the timm class ``stock``."""

    def register(cls: type[_L]) -> type[_L]:
        cls.laplacian_stock_class = stock
        LAPLACIAN_CLASSES[stock] = cls
        return cls

    return register


def _heads_of(module: Any) -> int:
    """Number of query heads of a timm attention module (``num_heads``; Hiera calls it ``heads``)."""
    n = getattr(module, "num_heads", None)
    return int(n if n is not None else module.heads)


class LaplacianLayer(nn.Module):
    """Base of every Laplacian timm attention class: the head selection and the Laplacian core.

    A Laplacian class is ``class LaplacianX(LaplacianLayer, X)`` for a timm class X (this class
    adds no parameter and no ``__init__``, only the marker buffer, so :func:`convert` can swap a
    module's class); its
    ``forward`` calls ``X.forward`` when no head is Laplacian (:attr:`laplacian_active` is False)
    and otherwise computes q, k, v and the additive mask as X does and calls
    :meth:`_laplacian_attend`.
    """

    if TYPE_CHECKING:  # the mixin's other attributes are those of the timm class it is mixed into

        def __getattr__(self, name: str) -> Any: ...

    #: the timm class this one converts (set by the registration).
    laplacian_stock_class: type = nn.Module
    #: axis of the heads in timm's own attention matrix (``(..., H, N, N)``); read by references.
    laplacian_head_axis: int = -3

    @classmethod
    def laplacian_refusal(cls, module: nn.Module) -> Optional[str]:
        """Why this instance of the timm class cannot be made Laplacian (None: it can)."""
        return None

    # ------------------------------------------------------------------ head selection
    def _init_laplacian(self, spec: Any) -> None:
        # Called by __init__ and by convert() (after a __class__ swap, where __init__ never ran).
        #: this layer's resolved selection (for learnable mixing: the heads that started Laplacian).
        self.laplacian_selection = LayerHeads((False,) * _heads_of(self))
        #: learnable mixing: lap_mix_a / lap_mix_b exist and drive the forward pass.
        self.laplacian_learnable = False
        self._register_marker()
        self.set_laplacian_heads(spec)

    def set_laplacian_heads(self, spec: Any) -> None:
        """Choose the Laplacian heads of this layer (int k, "all", "none", indices, a bool mask, or "learn...").

        A learnable spec (re)creates ``lap_mix_a`` / ``lap_mix_b`` at their initialisation; a fixed
        one removes them.
        """
        if isinstance(spec, LaplacianHeads) and spec.kind not in ("k", "all", "none", "ablation", "learn"):
            raise ConfigError(
                f"{spec!r} is per-layer; a single {type(self).__name__} layer needs one layer's selection. "
                "Use lapheads.timm.convert(model, spec) to apply a per-layer selection to a model"
            )
        # Validated and resolved once (a tensor spec is read back here, once, not per call).
        set_layer_heads(self, spec, _heads_of(self))

    @property
    def num_laplacian_heads(self) -> int:
        """Number of Laplacian heads in this layer (learnable: heads now nearer Laplacian than standard)."""
        if self.laplacian_learnable:
            return sum(
                nearer_laplacian(laplacianness(float(a), float(b)))
                for a, b in zip(self.lap_mix_a.tolist(), self.lap_mix_b.tolist())
            )
        return self.laplacian_selection.count

    @property
    def laplacian_active(self) -> bool:
        """True when the forward pass is Laplacian (a Laplacian head, or learnable mixing)."""
        return self.laplacian_learnable or self.laplacian_selection.any

    # ------------------------------------------------------------------ checkpoint marker
    def laplacian_codes(self) -> list[int]:
        """This layer's heads as the marker stores them: per head 0 standard, 1 Laplacian, 2 learnable mixing."""
        if self.laplacian_learnable:
            return [MIX_LEARNABLE] * _heads_of(self)
        return [MIX_LAPLACIAN if f else MIX_STANDARD for f in self.laplacian_selection.flags]

    def _register_marker(self) -> None:
        # A persistent buffer, so the key is in every state dict (torch.save, safetensors,
        # save_for_hf, distributed checkpoints) and a strict load into a stock timm layer refuses it.
        if MARKER not in self._buffers:
            device = next(self.parameters(), torch.empty(0)).device
            self.register_buffer(MARKER, torch.zeros(_heads_of(self), dtype=torch.int8, device=device))

    def _sync_marker(self) -> None:
        """Write the current selection into the marker (the selection itself is a Python attribute).

        A new tensor, and only when the marker holds other codes: no in-place write (inference
        mode), the same tensor object while the selection is unchanged.
        """
        codes = self.laplacian_codes()
        old = self._buffers[MARKER]
        assert old is not None
        if old.is_meta or old.tolist() != codes:
            self._buffers[MARKER] = torch.tensor(codes, dtype=torch.int8, device=old.device)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self._sync_marker()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # No marker: stock timm weights, the paper authors' checkpoints, files saved before the
        # marker existed: they load into any selection (retrofitting). A marker must match.
        key = prefix + MARKER
        saved = state_dict.get(key)
        own = self.laplacian_codes()
        if isinstance(saved, torch.Tensor) and not saved.is_meta and saved.shape == (len(own),):
            codes = [int(c) for c in saved.tolist()]
            if codes != own:
                error_msgs.append(
                    f"{prefix[:-1] or type(self).__name__}: the checkpoint has {describe_codes(codes)} but this "
                    f"layer has {describe_codes(own)}; load it into a model with the same heads "
                    "(lapheads.timm.create_model without laplacian_heads takes them from the checkpoint)"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if saved is None and key in missing_keys:
            missing_keys.remove(key)
        self._sync_marker()  # the buffer follows the selection, never the file

    # ------------------------------------------------------------------ the Laplacian core
    def _laplacian_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        *,
        is_causal: bool = False,
        scale: Optional[float] = None,
    ) -> torch.Tensor:
        """This layer's heads over ``q, k, v`` (heads on dim -3): ``V - P V`` on the Laplacian ones.

        Args:
            q, k, v: ``(..., H, N, D)`` as timm computes them (after norms and RoPE).
            attn_mask: boolean (True = attend) or additive float mask broadcastable to
                ``(..., H, N, N)``: position biases and window masks, already summed.
            is_causal: causal masking (wins over ``attn_mask`` on the eager path, timm's rule).
            scale: softmax scale; None = ``1 / sqrt(D)``.

        Returns:
            ``(..., H, N, Dv)``.
        """
        drop = getattr(self, "attn_drop", None)
        heads = layer_operator(self)
        if getattr(self, "fused_attn", True):
            return laplacian_attention(
                q,
                k,
                v,
                laplacian_heads=heads,
                attn_mask=attn_mask,
                is_causal=is_causal,
                scale=scale,
                dropout_p=drop.p if (drop is not None and self.training) else 0.0,
            )
        # Eager path: the explicit operator of lapheads.ops (timm's rule: is_causal wins over
        # attn_mask). Dropout acts on P only; a fully masked query row has P = 0, as when fused.
        out, _ = laplacian_attention_reference(
            q,
            k,
            v,
            laplacian_heads=heads,
            attn_mask=None if is_causal else attn_mask,
            is_causal=is_causal,
            scale=scale,
            dropout_p=getattr(drop, "p", 0.0) if (drop is not None and self.training) else 0.0,
        )
        return out

    def extra_repr(self) -> str:
        base = super().extra_repr()
        if self.laplacian_learnable:
            mine = f"num_heads={_heads_of(self)}, laplacian_heads=learnable a I + b P"
        else:
            mine = f"num_heads={_heads_of(self)}, laplacian_heads={list(self.laplacian_selection.indices)}"
        return f"{base}, {mine}" if base else mine


# ---------------------------------------------------------------------- shared pieces
def _biased_qkv(m: Any, x: torch.Tensor) -> torch.Tensor:
    """The fused q/k/v projection with timm's separate q/v biases (``k_bias`` is a zero buffer)."""
    if getattr(m, "q_bias", None) is None:
        return m.qkv(x)
    bias = torch.cat((m.q_bias, m.k_bias, m.v_bias))
    if getattr(m, "qkv_bias_separate", False):
        return m.qkv(x) + bias
    return F.linear(x, m.qkv.weight, bias)


def _split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, N, 3 * H * D)`` -> q, k, v of shape ``(B, H, N, D)`` (timm's q/k/v order)."""
    b, n, _ = qkv.shape
    q, k, v = qkv.reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, N, H * D)``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


def _as_mask(bias: Optional[torch.Tensor], q: torch.Tensor) -> Optional[torch.Tensor]:
    """An additive bias in the dtype of ``q`` (SDPA's rule; under autocast q is half, the bias float32)."""
    if bias is None or bias.dtype == torch.bool or bias.dtype == q.dtype:
        return bias
    return bias.to(q.dtype)


def _window_mask(bias: torch.Tensor, mask: Optional[torch.Tensor], batch: int) -> torch.Tensor:
    """Swin's per-window mask added to the position bias, as timm's fused branch builds it.

    Args:
        bias: ``(1, H, N, N)`` position bias.
        mask: ``(nW, N, N)`` 0 / -100 shifted-window mask, or None.
        batch: the windows' batch ``B * nW`` (window w of image b is row ``b * nW + w``).

    Returns:
        ``(1, H, N, N)`` without a mask, else ``(B * nW, H, N, N)``.
    """
    if mask is None:
        return bias
    nw, n = mask.shape[0], mask.shape[-1]
    h = bias.shape[1]
    full = bias.unsqueeze(1) + mask.to(bias.dtype).view(1, nw, 1, n, n)  # (1, nW, H, N, N)
    return full.expand(batch // nw, -1, -1, -1, -1).reshape(batch, h, n, n)


# ---------------------------------------------------------------------- the Laplacian classes
@_converts(Attention)
class LaplacianAttention(LaplacianLayer, Attention):
    """timm ``Attention`` whose selected heads output ``V - softmax(QK^T)V``.

    Same constructor as ``timm.layers.Attention`` plus ``laplacian_heads``.

    Args:
        dim: token width.
        num_heads: number of heads.
        *args: passed to ``timm.layers.Attention``.
        laplacian_heads: the heads of THIS layer that are Laplacian: an int k (trailing k heads),
            ``"all"``, ``"none"``, a list of head indices, a boolean mask of shape
            ``(num_heads,)`` or a :class:`lapheads.heads.LayerHeads`. ``None`` uses the class default
            ``default_laplacian_heads`` (``"none"`` here; see :meth:`with_heads`).
        **kwargs: passed to ``timm.layers.Attention`` (qkv_bias, qk_norm, attn_drop, proj_drop,
            norm_layer, scale_norm, ...).
    """

    #: selection used when the constructor gets ``laplacian_heads=None`` (timm never passes it).
    default_laplacian_heads: Any = "none"
    _variants: dict[tuple[type, str], type] = {}

    def __init__(self, dim: int, num_heads: int = 8, *args: Any, laplacian_heads: Any = None, **kwargs: Any):
        super().__init__(dim, num_heads, *args, **kwargs)
        self._init_laplacian(self.default_laplacian_heads if laplacian_heads is None else laplacian_heads)

    @classmethod
    def with_heads(cls, laplacian_heads: Any) -> type["LaplacianAttention"]:
        """A subclass whose default selection is ``laplacian_heads`` (same for every layer).

        Use it where timm wants a class: ``VisionTransformer(attn_layer=LaplacianAttention.with_heads(3))``.
        The class is cached per selection, so repeated calls return the same class.
        """
        spec = LaplacianHeads(laplacian_heads)
        if spec.kind not in ("k", "all", "none", "learn", "ablation"):
            raise ConfigError(
                f"LaplacianAttention.with_heads({laplacian_heads!r}): timm builds every layer with the same "
                "arguments, so only an int k, 'all' or 'none' fits here; use lapheads.timm.convert for per-layer heads"
            )
        key = (cls, str(spec.spec))
        if key not in cls._variants:
            name = f"{cls.__name__}_{str(spec.spec).replace(':', '_')}"
            cls._variants[key] = type(name, (cls,), {"default_laplacian_heads": spec.spec, "__module__": __name__})
        return cls._variants[key]

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, _ = x.shape
        gate_layer = getattr(self, "gate", None)  # timm >= 1.0.2x: optional sigmoid output gate
        gate = gate_layer(x).sigmoid() if gate_layer is not None else None
        attn_dim = getattr(self, "attn_dim", self.num_heads * self.head_dim)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = self._laplacian_attend(
            q, k, v, attn_mask, is_causal=is_causal, scale=None if self.fused_attn else self.scale
        )
        x = x.transpose(1, 2).reshape(B, N, attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class _LaplacianRope(LaplacianLayer):
    """EVA's attention and ``AttentionRope``: RoPE on the non-prefix tokens, sub-LN, gate."""

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, rope=rope, attn_mask=attn_mask, is_causal=is_causal)
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        if self.qkv is not None:
            q, k, v = _split_heads(_biased_qkv(self, x), self.num_heads)
        else:
            kv_heads = getattr(self, "num_kv_heads", self.num_heads)
            q = self.q_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # rotate every token but the prefix (class / register) tokens
            npt, half = self.num_prefix_tokens, getattr(self, "rotate_half", False)
            q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], dim=2).type_as(v)
            k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], dim=2).type_as(v)
        groups = self.num_heads // k.shape[1]
        if groups > 1:  # grouped-query K/V: query head h reads K/V head h // groups, as timm expands them
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        x = _merge_heads(self._laplacian_attend(q, k, v, attn_mask, is_causal=is_causal))
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


@_converts(EvaAttention)
class LaplacianEvaAttention(_LaplacianRope, EvaAttention):
    """``timm.models.eva.EvaAttention`` with Laplacian heads (EVA, EVA-02, DINOv3, timm's RoPE ViTs)."""


@_converts(AttentionRope)
class LaplacianAttentionRope(_LaplacianRope, AttentionRope):
    """``timm.layers.AttentionRope`` with Laplacian heads (RoPE-ViT, EVA ``attn_type='rope'``, Qwen3 / DeepSeek ViT)."""


@_converts(BeitAttention)
class LaplacianBeitAttention(LaplacianLayer, BeitAttention):
    """``timm.models.beit.Attention`` with Laplacian heads: q/v biases, own and shared relative position bias."""

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, shared_rel_pos_bias=shared_rel_pos_bias)
        q, k, v = _split_heads(_biased_qkv(self, x), self.num_heads)
        bias = self._get_rel_pos_bias() if self.relative_position_bias_table is not None else None
        if shared_rel_pos_bias is not None:
            bias = shared_rel_pos_bias if bias is None else bias + shared_rel_pos_bias
        x = _merge_heads(self._laplacian_attend(q, k, v, _as_mask(bias, q)))
        return self.proj_drop(self.proj(x))


@_converts(SwinWindowAttention)
class LaplacianSwinWindowAttention(LaplacianLayer, SwinWindowAttention):
    """Swin's ``WindowAttention`` with Laplacian heads: per window, relative position bias, shifted-window mask."""

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, mask=mask)
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        bias = _window_mask(self._get_rel_pos_bias(), mask, x.shape[0])
        x = _merge_heads(
            self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=None if self.fused_attn else self.scale)
        )
        return self.proj_drop(self.proj(x))


def _swinv2_position_bias(m: Any) -> torch.Tensor:
    """Swin v2's continuous position bias ``16 * sigmoid(cpb_mlp(coords))`` gathered to ``(1, H, N, N)``."""
    n = m.window_size[0] * m.window_size[1]
    table = m.cpb_mlp(m.relative_coords_table).view(-1, m.num_heads)
    bias = table[m.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
    return (16 * torch.sigmoid(bias)).unsqueeze(0)


@_converts(SwinV2WindowAttention)
class LaplacianSwinV2WindowAttention(LaplacianLayer, SwinV2WindowAttention):
    """Swin v2's ``WindowAttention`` with Laplacian heads: cosine attention with the clamped logit scale,
    continuous position bias and the shifted-window mask, through the operator at scale 1."""

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, mask=mask)
        q, k, v = _split_heads(_biased_qkv(self, x), self.num_heads)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()  # (H, 1, 1), timm's clamp
        q, k = F.normalize(q, dim=-1) * logit_scale, F.normalize(k, dim=-1)
        bias = _window_mask(_swinv2_position_bias(self), mask, x.shape[0])
        x = _merge_heads(self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=1.0))
        return self.proj_drop(self.proj(x))


@_converts(RelPosAttention)
class LaplacianRelPosAttention(LaplacianLayer, RelPosAttention):
    """``RelPosAttention`` (RelPos ViT) with Laplacian heads: its own ``rel_pos`` bias, else the shared one."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, shared_rel_pos=shared_rel_pos)
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        q, k = self.q_norm(q), self.k_norm(k)
        rel_pos: Any = self.rel_pos
        bias = rel_pos.get_bias() if rel_pos is not None else shared_rel_pos
        x = _merge_heads(
            self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=None if self.fused_attn else self.scale)
        )
        return self.proj_drop(self.proj(x))


@_converts(MaskUnitAttention)
class LaplacianMaskUnitAttention(LaplacianLayer, MaskUnitAttention):
    """Hiera's ``MaskUnitAttention`` with Laplacian heads, mask-unit (windowed) or global.

    Layers that pool their queries (``q_stride > 1``, the first block of a stage) are not
    converted: a pooled query is no token among the keys.
    """

    @classmethod
    def laplacian_refusal(cls, module: nn.Module) -> Optional[str]:
        stride = int(getattr(module, "q_stride", 1))
        if stride > 1:
            return f"pools its queries (q_stride={stride}), so a query is no token among the keys and has no own value"
        return None

    @property
    def laplacian_head_axis(self) -> int:  # type: ignore[override]
        return -4 if self.use_mask_unit_attn else -3  # timm's (B, H, windows, N, N) vs (B, H, N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x)
        B, N, _ = x.shape
        if self.use_mask_unit_attn:
            windows = N // (self.q_stride * self.window_size)
            # (3, B, windows, H, tokens, D): heads on dim -3 for the operator
            q, k, v = self.qkv(x).reshape(B, -1, windows, 3, self.heads, self.head_dim).permute(3, 0, 2, 4, 1, 5)
            out = self._laplacian_attend(q, k, v)
            x = out.permute(0, 3, 1, 2, 4).reshape(B, -1, self.dim_out)  # timm's (B, tokens, windows, H, D)
        else:
            q, k, v = _split_heads(self.qkv(x), self.heads)
            x = _merge_heads(self._laplacian_attend(q, k, v))
        return self.proj(x)


@_converts(LevitAttention)
class LaplacianLevitAttention(LaplacianLayer, LevitAttention):
    """LeViT's ``Attention`` with Laplacian heads: learned attention biases, linear or conv layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x)
        split = [self.key_dim, self.key_dim, self.val_dim]
        bias = self.get_attention_biases(x.device)  # (H, N, N)
        if self.use_conv:
            B, _, H, W = x.shape
            q, k, v = (t.transpose(-2, -1) for t in self.qkv(x).view(B, self.num_heads, -1, H * W).split(split, dim=2))
            out = self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=self.scale)
            x = out.transpose(-2, -1).reshape(B, -1, H, W)
        else:
            B, N, _ = x.shape
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, N, self.num_heads, -1).split(split, dim=3))
            out = self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=self.scale)
            x = out.transpose(1, 2).reshape(B, N, self.val_attn_dim)
        return self.proj(x)


class _LaplacianPlainQKV(LaplacianLayer):
    """Attention that is one fused q/k/v projection, SDPA and an output projection (nothing else)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x)
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        x = self.proj(_merge_heads(self._laplacian_attend(q, k, v, scale=None if self.fused_attn else self.scale)))
        drop = getattr(self, "proj_drop", None)
        return drop(x) if drop is not None else x


@_converts(MetaFormerAttention)
class LaplacianMetaFormerAttention(_LaplacianPlainQKV, MetaFormerAttention):
    """MetaFormer's ``Attention`` (CAFormer's attention stages) with Laplacian heads."""


@_converts(DavitWindowAttention)
class LaplacianDavitWindowAttention(_LaplacianPlainQKV, DavitWindowAttention):
    """DaViT's spatial ``WindowAttention`` with Laplacian heads (its channel attention stays standard)."""


@_converts(MaxxVitAttention2d)
class LaplacianMaxxVitAttention2d(LaplacianLayer, MaxxVitAttention2d):
    """MaxxViT's ``Attention2d`` (NCHW, CoAtNet-style blocks) with Laplacian heads."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, shared_rel_pos=shared_rel_pos)
        B, _, H, W = x.shape
        if self.head_first:
            q, k, v = self.qkv(x).view(B, self.num_heads, self.dim_head * 3, -1).chunk(3, dim=2)
        else:
            q, k, v = self.qkv(x).reshape(B, 3, self.num_heads, self.dim_head, -1).unbind(1)
        q, k, v = q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)  # (B, H, N, D)
        rel_pos: Any = self.rel_pos
        bias = rel_pos.get_bias() if rel_pos is not None else shared_rel_pos
        out = self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(-1, -2).reshape(B, -1, H, W)))


@_converts(MaxxVitAttentionCl)
class LaplacianMaxxVitAttentionCl(LaplacianLayer, MaxxVitAttentionCl):
    """MaxxViT's channels-last ``AttentionCl`` (MaxViT's block and grid partitions) with Laplacian heads."""

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.laplacian_active:
            return super().forward(x, shared_rel_pos=shared_rel_pos)
        B, shape = x.shape[0], x.shape[:-1]
        if self.head_first:
            q, k, v = self.qkv(x).view(B, -1, self.num_heads, self.dim_head * 3).transpose(1, 2).chunk(3, dim=3)
        else:
            q, k, v = self.qkv(x).reshape(B, -1, 3, self.num_heads, self.dim_head).transpose(1, 3).unbind(2)
        rel_pos: Any = self.rel_pos
        bias = rel_pos.get_bias() if rel_pos is not None else shared_rel_pos
        out = self._laplacian_attend(q, k, v, _as_mask(bias, q), scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(shape + (-1,))))


# ---------------------------------------------------------------------- what is not converted, and why
_NO_OWN_QUERY = "so a query is no token among the keys and has no own value"
_SPATIAL_REDUCTION = (
    "spatial-reduction attention: the keys and values are pooled tokens, so a query's own value is not among them"
)
_CHANNELS = "attends over channels, not tokens, so no token has an own value among the keys"
_CLASS_ATTN = "class attention: only the class token queries, the other tokens are keys only"
_NO_P = "has no softmax over query-key scores, so there is no P to subtract from the identity"

#: timm attention classes that are refused, by ``module.qualname``, with the reason.
REFUSED_CLASSES: dict[str, str] = {
    "timm.models.pvt_v2.Attention": _SPATIAL_REDUCTION,
    "timm.models.twins.GlobalSubSampleAttn": _SPATIAL_REDUCTION,
    "timm.models.nextvit.EfficientAttention": _SPATIAL_REDUCTION,
    "timm.models.mvitv2.MultiScaleAttention": (
        "pooling attention: queries and keys / values are pooled tokens, so a query's own value is not among the keys"
    ),
    "timm.models.xcit.XCA": f"cross-covariance attention {_CHANNELS}",
    "timm.models.edgenext.CrossCovarianceAttn": f"cross-covariance attention {_CHANNELS}",
    "timm.models.davit.ChannelAttention": f"channel attention {_CHANNELS}",
    "timm.models.davit.ChannelAttentionV2": f"channel attention {_CHANNELS}",
    "timm.models.cait.ClassAttn": _CLASS_ATTN,
    "timm.models.volo.ClassAttention": _CLASS_ATTN,
    "timm.layers.attention_pool.AttentionPoolLatent": (
        "latent-query pooling: the queries are learned latents, not tokens"
    ),
    "timm.layers.attention_pool2d.AttentionPool2d": "attention pooling: the query is the pooled token, not a token",
    "timm.layers.attention_pool2d.RotAttentionPool2d": "attention pooling: the query is the pooled token, not a token",
    "timm.models.crossvit.CrossAttention": "cross-attention: the query is the other branch's class token",
    "timm.models.levit.AttentionDownsample": f"subsamples its queries (stride 2), {_NO_OWN_QUERY}",
    "timm.models.efficientformer_v2.Attention2dDownsample": f"subsamples its queries (stride 2), {_NO_OWN_QUERY}",
    "timm.models.cait.TalkingHeadAttn": (
        "talking-heads attention mixes the heads before and after the softmax, so no head has a P of its own"
    ),
    "timm.models.efficientvit_mit.LiteMLA": f"linear (ReLU-kernel) attention {_NO_P}",
    "timm.models.swiftformer.EfficientAdditiveAttention": f"additive attention with one global query {_NO_P}",
    "timm.models.coat.FactorAttnConvRelPosEnc": f"factorized attention (softmax over keys, then K^T V) {_NO_P}",
    "timm.models.volo.OutlookAttention": f"outlook attention (local weights predicted from the centre token) {_NO_P}",
    "timm.layers.split_attn.SplitAttn": "split attention weighs convolution branches per channel: no token attention",
    "timm.layers.selective_kernel.SelectiveKernelAttn": (
        "selective-kernel attention weighs convolution kernels per channel: no token attention"
    ),
    "timm.layers.split_attn.RadixSoftmax": "split attention's softmax over convolution branches: no token attention",
    "timm.models.efficientvim.HSMSSD": "a state-space token mixer (hidden-state SSD) has no token-to-token softmax P",
}

_ATTENTION_NAME = re.compile(r"attn|attention|mhsa|shsa|gpsa|shma", re.IGNORECASE)
_ATTENTION_CODE = re.compile(r"softmax|scaled_dot_product_attention")
_SOURCE_SAYS_ATTENTION: dict[type, bool] = {}


def _computes_attention(cls: Any) -> bool:
    """Whether ``cls.forward`` (its source, read once per class) calls a softmax or SDPA."""
    if cls not in _SOURCE_SAYS_ATTENTION:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _SOURCE_SAYS_ATTENTION[cls] = bool(_ATTENTION_CODE.search(source))
    return _SOURCE_SAYS_ATTENTION[cls]


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _convertible(module: nn.Module) -> bool:
    if isinstance(module, LaplacianLayer):
        return True
    lap = LAPLACIAN_CLASSES.get(type(module))
    return lap is not None and lap.laplacian_refusal(module) is None


def _looks_like_attention(module: nn.Module) -> bool:
    cls = type(module)
    if _class_key(cls) in REFUSED_CLASSES or cls in LAPLACIAN_CLASSES:
        return True
    if cls.__module__.startswith("torch.") or cls.__name__.endswith(("Block", "Stage")):
        return False  # torch's own layers (nn.Softmax), and timm's blocks wrapping an attention module
    return bool(_ATTENTION_NAME.search(cls.__name__)) or _computes_attention(cls)


def laplacian_attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every convertible attention layer, in forward (block) order."""
    return [(n, m) for n, m in model.named_modules() if _convertible(m)]


def skipped_attention_layers(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(name, class name, reason)`` of every attention module of ``model`` that :func:`convert` leaves standard.

    An attention module is an instance of a class lapheads converts (which may refuse the instance:
    Hiera's query-pooling layers), of a class in :data:`REFUSED_CLASSES`, or of any other class
    that is named like attention (``*Attn*``, ``*Attention*``, ``*MHSA*``, ...) or whose
    ``forward`` calls a softmax or SDPA, unless it only wraps such a module (a block) or is part of
    one already accounted for.
    """
    out: list[tuple[str, str, str]] = []
    seen: tuple[str, ...] = ()  # prefixes of the attention modules accounted for: their parts are not listed
    for name, m in model.named_modules():
        if seen and name.startswith(seen):
            continue
        if not _convertible(m) and not _looks_like_attention(m):
            continue
        lap = LAPLACIAN_CLASSES.get(type(m))
        if _convertible(m):
            reason = None
        elif lap is not None:
            reason = lap.laplacian_refusal(m)
        elif _class_key(type(m)) in REFUSED_CLASSES:
            reason = REFUSED_CLASSES[_class_key(type(m))]
        elif any(_looks_like_attention(c) for c in m.modules() if c is not m):
            continue  # a wrapper: its attention module is listed itself
        else:
            reason = "lapheads has no Laplacian form of this attention class yet"
        if reason is not None:
            out.append((name, type(m).__name__, reason))
        seen += (f"{name}." if name else "",)
    return out


def laplacian_head_counts(model: nn.Module) -> list[int]:
    """Number of Laplacian heads in each convertible attention layer of ``model`` (0 for a plain timm layer)."""
    return [m.num_laplacian_heads if isinstance(m, LaplacianLayer) else 0 for _, m in laplacian_attention_layers(model)]


def _nothing_to_convert(model: nn.Module) -> ConfigError:
    skipped = skipped_attention_layers(model)
    if not skipped:
        return ConfigError(
            f"{type(model).__name__} has no self-attention layer, so it has no heads to make "
            "Laplacian; use a model with attention (vit_*, deit3_*, eva02_*, swin_*, beit_*, ...)"
        )
    reasons = list(dict.fromkeys(f"{cls} ({reason})" for _, cls, reason in skipped))
    return ConfigError(
        f"{type(model).__name__} has no attention layer lapheads can make Laplacian: " + "; ".join(reasons)
    )


def _layer_selections(spec: LaplacianHeads, heads: list[int]) -> list[LayerHeads]:
    """One selection per layer, each validated against ITS head count (Swin, MaxViT, LeViT and Hiera
    widen from stage to stage); the errors name the entry at fault as ``resolve`` does."""
    n = len(heads)
    if spec.kind not in ("per_layer_k", "per_layer_indices"):
        return [spec.init_selection(n, h)[i] for i, h in enumerate(heads)]
    if len(spec.spec) != n:
        spec.resolve(n, max(heads))  # raises the "per-layer entries but the model has n layers" error
    blank: Any = 0 if spec.kind == "per_layer_k" else []
    return [
        LaplacianHeads([entry if j == i else blank for j, entry in enumerate(spec.spec)]).resolve(n, h)[i]
        for i, h in enumerate(heads)
    ]


def convert(model: nn.Module, laplacian_heads: HeadSpec) -> nn.Module:
    """Turn the attention of a timm model into Laplacian attention, in place, keeping every weight.

    Every module whose class is a key of :data:`LAPLACIAN_CLASSES` (and whose own value is among
    its keys) gets its Laplacian class; other attention modules stay standard
    (:func:`skipped_attention_layers` lists them with the reason). A fixed selection creates no
    parameter; a learnable one (``"learn..."``) adds ``lap_mix_a`` / ``lap_mix_b`` to every
    converted layer (create the optimizer after converting).

    Args:
        model: a timm model with convertible attention (ViT, DeiT-3, EVA / EVA-02, DINOv3, RoPE ViT,
            BEiT, Swin, Swin v2, RelPos ViT, Hiera, LeViT, MaxViT, ...); already converted layers
            are re-selected.
        laplacian_heads: anything :class:`lapheads.LaplacianHeads` accepts: int k (trailing k heads
            of every layer), ``"all"``, ``"none"``, a per-layer list of counts or of head indices
            (one entry per layer of :func:`laplacian_attention_layers`). Validated against the
            model before anything is changed.

    Returns:
        the same ``model`` object, with ``model.laplacian_heads`` set to the selection.

    Raises:
        ConfigError: the model has no convertible attention layer (the message names its attention
            classes and why each is refused), or the selection does not fit the model.
    """
    spec = LaplacianHeads(laplacian_heads)
    layers = laplacian_attention_layers(model)
    if not layers:
        raise _nothing_to_convert(model)
    # Resolve every layer first (each with its own head count) so a bad spec changes nothing.
    masks: list[Any] = _layer_selections(spec, [_heads_of(m) for _, m in layers])
    if spec.learnable:
        masks = [spec] * len(layers)  # each layer registers its (a, b) at the spec's initialisation
    for (_, m), mask in zip(layers, masks):
        if isinstance(m, LaplacianLayer):
            m.set_laplacian_heads(mask)
        else:
            # Class swap: a Laplacian class adds no parameter, so the module keeps its tensors.
            m.__class__ = LAPLACIAN_CLASSES[type(m)]
            cast(Any, m)._init_laplacian(mask)
    # plain attributes, not submodules: object.__setattr__ keeps nn.Module's typed __setattr__ out
    object.__setattr__(model, "laplacian_heads", spec)
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        object.__setattr__(model, "pretrained_cfg", dict(cfg, laplacian_heads=spec.to_config()))
    return model


def _split_lap_name(name: str) -> tuple[str, Optional[int]]:
    """``deit3_base_patch16_224_lap12`` -> (``deit3_base_patch16_224``, 12); other names -> (name, None)."""
    m = _LAP_NAME.match(name)
    if m and m.group("base") in VARIANT_BASES:
        return m.group("base"), int(m.group("k"))
    return name, None


def _unknown_model(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, timm.list_models() + REGISTERED_MODELS, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models() for names"
    return ConfigError(f"unknown timm model name {name!r}{hint}")


def create_model(name: str, laplacian_heads: HeadSpec = None, **timm_kwargs: Any) -> nn.Module:
    """Create a timm model with Laplacian heads, or reload a saved one.

    Args:
        name: any timm model name with attention :func:`convert` converts (``vit_small_patch16_224``,
            ``deit3_base_patch16_224.fb_in1k``, ``eva02_small_patch14_224``, ``vit_small_patch16_dinov3``,
            ``swin_tiny_patch4_window7_224``, ``beit_base_patch16_224``, ...), a registered
            variant ``<base>_lap<k>`` (k then comes from the name), or a model saved with
            ``timm.models.save_for_hf`` / ``push_to_hf_hub``: ``local-dir:PATH`` or ``hf-hub:REPO``
            (its ``config.json`` gives the architecture, and the weights load by default).
        laplacian_heads: the selection (see :func:`convert`). ``None`` = the checkpoint's heads
            when weights are loaded from a Laplacian checkpoint (its markers, or the saved
            ``pretrained_cfg``), else none, or k from a ``_lap<k>`` name. A selection given
            with a Laplacian checkpoint replaces its heads on purpose (retrofitting). Giving both
            a ``_lap<k>`` name and a different selection is an error.
        **timm_kwargs: passed to ``timm.create_model`` (``pretrained``, ``pretrained_cfg_overlay``,
            ``checkpoint_path``, ``num_classes``, ``img_size``, ``patch_size``, ``embed_dim``,
            ``depth``, ``num_heads``, ``qk_norm``, ``drop_path_rate``, ``init_values``, ...).

    Returns:
        the converted model; ``model.laplacian_heads`` holds the selection.

    Raises:
        ConfigError: an unknown name, a selection that does not fit, a ``_lap<k>`` name with
            ``pretrained=True`` and no checkpoint to load.
        RuntimeError: timm's strict load: weights of another architecture.
    """
    saved = _saved_model_config(name, timm_kwargs.get("cache_dir"))
    if saved is not None:
        cfg, name, model_args = saved
        if timm_kwargs.get("pretrained_cfg") is not None:
            raise ConfigError(
                "pretrained_cfg cannot be given with a local-dir: or hf-hub: name: its config.json is the "
                "pretrained_cfg (use pretrained_cfg_overlay to change entries)"
            )
        timm_kwargs["pretrained_cfg"] = cfg
        timm_kwargs.setdefault("pretrained", True)
        for key, value in model_args.items():
            timm_kwargs.setdefault(key, value)
        if model_args and _TIMM_TAKES_MODEL_ARGS:
            timm_kwargs.setdefault("pretrained_model_args", dict(model_args))
    replaces = laplacian_heads is not None  # the caller's heads replace a checkpoint's on purpose
    base, k = _split_lap_name(name)
    if k is not None:
        if laplacian_heads is not None and LaplacianHeads(laplacian_heads) != LaplacianHeads(k):
            raise ConfigError(
                f"model name {name!r} means laplacian_heads={k}, but laplacian_heads={laplacian_heads!r} was "
                f"also given; use the base name {base!r} with laplacian_heads, or drop laplacian_heads"
            )
        laplacian_heads = k
    LaplacianHeads(laplacian_heads)  # validate the type before building anything
    if not timm.is_model(base):
        raise _unknown_model(name)
    return _create(name, base, laplacian_heads, timm_kwargs, replaces=replaces)


# ---------------------------------------------------------------------- checkpoints
_TIMM_TAKES_MODEL_ARGS = "pretrained_model_args" in inspect.signature(timm.models.build_model_with_cfg).parameters
_WEIGHT_SOURCE_KEYS = ("state_dict", "source", "file", "url", "hf_hub_id", "hf_hub_filename")


def _saved_model_config(name: str, cache_dir: Any = None) -> Optional[tuple[dict[str, Any], str, dict[str, Any]]]:
    """``local-dir:PATH`` / ``hf-hub:REPO`` -> (pretrained_cfg, architecture, model_args) of its
    ``config.json``, read by timm's own functions; any other name -> None."""
    if not name.startswith(("local-dir:", "hf-hub:", "hf_hub:")):
        return None
    source, ident = timm.models.parse_model_name(name)
    if source == "local-dir":
        from timm.models._hub import load_model_config_from_path  # not re-exported by timm.models

        try:
            return load_model_config_from_path(ident)
        except FileNotFoundError as e:
            raise ConfigError(f"{name!r}: {e}; save a model there with timm.models.save_for_hf(model, PATH)") from None
    if source == "hf-hub":
        return timm.models.load_model_config_from_hf(ident, **_cache(cache_dir))
    return None


def _cache(cache_dir: Any) -> dict[str, Any]:
    """timm's ``cache_dir`` keyword, passed on only when given."""
    return {} if cache_dir is None else {"cache_dir": cache_dir}


def _named_weights(cfg: dict[str, Any], cache_dir: Any = None) -> Optional[dict[str, torch.Tensor]]:
    """The state dict ``cfg`` (a saved model's ``pretrained_cfg`` with the caller's overlay) points
    timm to, read by timm's own loaders: an in-memory ``state_dict``, a ``local-dir`` / ``hf-hub``
    source, a ``file``. None when it names none (timm's registry weights: stock, never Laplacian)."""
    if cfg.get("state_dict") is not None:
        return dict(cfg["state_dict"])
    if cfg.get("source") == "local-dir":
        from timm.models._hub import load_state_dict_from_path  # not re-exported by timm.models

        return load_state_dict_from_path(cfg["file"])
    if cfg.get("source") == "hf-hub":
        extra = [cfg["hf_hub_filename"]] if cfg.get("hf_hub_filename") else []
        return timm.models.load_state_dict_from_hf(cfg["hf_hub_id"], *extra, **_cache(cache_dir))
    if cfg.get("file"):
        return timm.models.load_state_dict(str(cfg["file"]))
    return None


def _markers(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Layer name -> marker codes of every marked layer of a state dict."""
    return {
        k[: -len(MARKER)].rstrip("."): [int(c) for c in v.tolist()]
        for k, v in state.items()
        if (k == MARKER or k.endswith("." + MARKER)) and isinstance(v, torch.Tensor)
    }


def _layer_codes(model: nn.Module) -> dict[str, list[int]]:
    return {n: m.laplacian_codes() for n, m in laplacian_attention_layers(model) if isinstance(m, LaplacianLayer)}


def _selection_from_markers(model: nn.Module, markers: dict[str, list[int]]) -> Any:
    """The selection that gives ``model``'s layers the checkpoint's heads: an int k when every layer
    has its trailing k heads Laplacian, ``"learn"`` for learnable mixing, else per-layer indices."""
    layers = laplacian_attention_layers(model)
    unknown = sorted(set(markers) - {n for n, _ in layers})
    if unknown:
        raise ConfigError(
            f"the checkpoint marks Laplacian layers this model does not have ({', '.join(unknown[:3])}); "
            "build the architecture it was saved from"
        )
    codes = [markers.get(n, [MIX_STANDARD] * _heads_of(m)) for n, m in layers]
    learn = [all(c == MIX_LEARNABLE for c in cs) for cs in codes]
    if all(learn):
        return "learn"
    if any(learn):
        raise ConfigError(
            "the checkpoint has learnable mixing in some layers and fixed heads in others, which no "
            "laplacian_heads setting rebuilds; give laplacian_heads and load its mixing yourself"
        )
    indices = [[h for h, c in enumerate(cs) if c == MIX_LAPLACIAN] for cs in codes]
    ks = {len(i) for i in indices}
    if len(ks) == 1 and all(i == list(range(len(cs) - len(i), len(cs))) for i, cs in zip(indices, codes)):
        return ks.pop()
    return indices


def _pretrained_cfg(model: nn.Module) -> dict[str, Any]:
    return dict(model.__dict__.get("pretrained_cfg") or {})


def _set_pretrained_cfg(model: nn.Module, cfg: dict[str, Any]) -> None:
    """timm's ``pretrained_cfg`` and its alias ``default_cfg``: plain attributes, not submodules."""
    object.__setattr__(model, "pretrained_cfg", cfg)
    object.__setattr__(model, "default_cfg", cfg)


def _split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what a stock timm model has, the Laplacian part: markers and learnable mixing)."""
    stock = {k: v for k, v in state.items() if not _LAPLACIAN_KEY.search(k)}
    return stock, {k: v for k, v in state.items() if _LAPLACIAN_KEY.search(k)}


def _create(
    name: str, base: str, laplacian_heads: HeadSpec, timm_kwargs: dict[str, Any], *, replaces: bool
) -> nn.Module:
    """timm builds the stock model and loads the stock part of the weights (its filters and its
    class-count and channel rules apply); the model is converted to the selection; then the
    Laplacian part of the weights (markers, learnable mixing) loads into the converted model.

    ``laplacian_heads`` None: the checkpoint's heads (the saved ``pretrained_cfg`` entry, else its
    markers). Given with ``replaces``: those heads, the checkpoint's markers dropped (retrofitting).
    Given without (a ``_lap<k>`` name): those heads, and the checkpoint's markers must agree.
    """
    kw = dict(timm_kwargs)
    pretrained = bool(kw.pop("pretrained", False))
    cfg_arg, overlay = kw.pop("pretrained_cfg", None), kw.pop("pretrained_cfg_overlay", None)
    checkpoint_path = kw.pop("checkpoint_path", None)
    user_cfg = dict(cfg_arg) if isinstance(cfg_arg, dict) else {}
    saved_spec = user_cfg.pop("laplacian_heads", None)
    named = {**user_cfg, **(overlay or {})}
    state = _named_weights(named, kw.get("cache_dir")) if pretrained else None
    _, k = _split_lap_name(name)
    if pretrained and state is None and k is not None:
        raise _no_pretrained(name, base, k)
    lap: dict[str, torch.Tensor] = {}
    if state is not None:
        stock, lap = _split_state(state)
        overlay = {**(overlay or {}), **dict.fromkeys(_WEIGHT_SOURCE_KEYS), "state_dict": stock}
    model = timm.create_model(
        base,
        pretrained=pretrained,
        pretrained_cfg=user_cfg if isinstance(cfg_arg, dict) else cfg_arg,
        pretrained_cfg_overlay=overlay,
        **kw,
    )
    if state is not None:  # the weights' source as the caller named it, not the in-memory copy
        cfg = {k: v for k, v in _pretrained_cfg(model).items() if k not in _WEIGHT_SOURCE_KEYS}
        cfg.update({k: named[k] for k in _WEIGHT_SOURCE_KEYS if k != "state_dict" and named.get(k) is not None})
        _set_pretrained_cfg(model, cfg)
    if k is not None:  # a registered variant: its own name, whatever timm built it from
        _set_pretrained_cfg(model, dict(_pretrained_cfg(model), architecture=name))
    loaded = timm.models.load_state_dict(str(checkpoint_path)) if checkpoint_path else None
    markers = _markers(loaded if loaded is not None else lap)
    spec: Any = laplacian_heads if laplacian_heads is not None else saved_spec
    try:
        convert(model, spec)
        if laplacian_heads is None and markers and any(_layer_codes(model).get(n) != c for n, c in markers.items()):
            convert(model, _selection_from_markers(model, markers))
    except ConfigError as e:
        raise ConfigError(f"model {name!r}: {e}") from None
    own = model.state_dict()
    keep = not replaces
    if lap:
        part = {k: v for k, v in lap.items() if k in own and (keep or not k.endswith(MARKER))}
        left = sorted(set(lap) - set(own))
        if keep and left:
            raise ConfigError(
                f"model {name!r}: the checkpoint has Laplacian entries this model has no place for "
                f"({', '.join(left[:3])}); build the architecture it was saved from"
            )
        model.load_state_dict(part, strict=False)
    if loaded is not None:  # timm.models.load_checkpoint's strict load, into the converted model
        model.load_state_dict(
            {
                k: v
                for k, v in loaded.items()
                if keep or not _LAPLACIAN_KEY.search(k) or (k in own and not k.endswith(MARKER))
            },
            strict=True,
        )
    return model


# ---------------------------------------------------------------------- timm registration
def _no_pretrained(name: str, base: str, k: int) -> ConfigError:
    return ConfigError(
        f"no pretrained weights exist for {name!r}; use pretrained=False, or start from the baseline weights "
        f"with lapheads.timm.create_model({base!r}, pretrained=True, laplacian_heads={k}), or load a saved "
        f"checkpoint with pretrained_cfg_overlay=dict(file=PATH) or a local-dir: / hf-hub: name"
    )


def _make_entrypoint(base: str, k: int):
    name = f"{base}_lap{k}"

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        # timm.create_model hands pretrained_cfg / overlay / cache_dir to every entrypoint; a
        # pretrained_cfg read from a saved model (local-dir:, hf-hub:) or an overlay naming a file
        # points at Laplacian weights, which load; without such a source there are no weights.
        if not pretrained:
            for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "pretrained_model_args"):
                kwargs.pop(key, None)
        model = _create(name, base, k, dict(kwargs, pretrained=pretrained), replaces=False)
        if not pretrained:
            _set_pretrained_cfg(model, dict(_pretrained_cfg(model), tag=None, hf_hub_id=None, url="", file=None))
        return model

    entrypoint.__name__ = name
    entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = (
        f"timm {base} with the trailing {k} heads of every layer Laplacian (pretrained: only from a saved checkpoint)."
    )
    return entrypoint


def _register_variants() -> list[str]:
    names = []
    mod = sys.modules[__name__]
    for base, n_heads in VARIANT_BASES.items():
        for k in range(1, n_heads + 1):
            fn = _make_entrypoint(base, k)
            setattr(mod, fn.__name__, fn)  # timm's register_model looks the function up in its module
            if fn.__name__ not in timm.models._registry._model_entrypoints:
                timm.models.register_model(fn)
            names.append(fn.__name__)
    return names


#: every timm name registered by importing this module.
REGISTERED_MODELS: list[str] = _register_variants()
