"""The Laplacian twins of timm's attention classes (:data:`LAPLACIAN_CLASSES`) and their base, :class:`LaplacianLayer`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
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

from ..epilogue import LAPLACIAN
from ..errors import ConfigError
from ..heads import LaplacianHeads, LayerHeads, laplacianness, layer_operator, nearer_laplacian, set_layer_heads
from ..ops import laplacian_attention, laplacian_attention_reference, mask_like

#: timm attention class -> its Laplacian twin (filled as the twins are defined).
LAPLACIAN_CLASSES: dict[type, type["LaplacianLayer"]] = {}

#: name of the marker buffer of every converted layer: one int8 per head, the codes below.
MARKER = "lap_heads"
#: name of the buffer of a layer with fixed mixing heads (an ablation): their ``(a, b)`` as the bit
#: patterns of two float64 in an int64 tensor, so casting the model (``half()``, ``to(bfloat16)``)
#: never rounds them.
COEF = "lap_coef"
#: marker codes: standard, Laplacian ``(1, -1)``, learnable mixing, fixed mixing ``(a, b)`` from :data:`COEF`.
MIX_STANDARD, MIX_LAPLACIAN, MIX_LEARNABLE, MIX_FIXED = 0, 1, 2, 3


def describe_codes(codes: list[int], coef: Optional[tuple[float, float]] = None) -> str:
    """A marker's codes in words: ``Laplacian heads [2, 3] of 4``, ``learnable mixing of 4 heads``,
    ``heads [3] of 4 mixing a I + b P with (a, b) = (1, 0)``, ``no Laplacian head of 4``."""
    if codes and all(c == MIX_LEARNABLE for c in codes):
        return f"learnable mixing of {len(codes)} heads"
    lap = [h for h, c in enumerate(codes) if c == MIX_LAPLACIAN]
    fixed = [h for h, c in enumerate(codes) if c == MIX_FIXED]
    mix = f" mixing a I + b P with (a, b) = ({coef[0]:g}, {coef[1]:g})" if fixed and coef is not None else ""
    parts = ([f"Laplacian heads {lap}"] if lap else []) + ([f"heads {fixed}"] if fixed else [])
    return f"{' and '.join(parts)} of {len(codes)}{mix}" if parts else f"no Laplacian head of {len(codes)}"


def encode_coef(coef: tuple[float, float], device: Any = None) -> torch.Tensor:
    """``(a, b)`` -> the :data:`COEF` buffer (float64 bit patterns as int64)."""
    return torch.tensor(coef, dtype=torch.float64).view(torch.int64).to(device)


def decode_coef(t: torch.Tensor) -> Optional[tuple[float, float]]:
    """The :data:`COEF` buffer -> ``(a, b)``; None for a tensor that is no such buffer."""
    if t.dtype != torch.int64 or tuple(t.shape) != (2,) or t.is_meta:
        return None
    a, b = t.detach().cpu().view(torch.float64).tolist()
    return float(a), float(b)


def anchor_of(module: nn.Module) -> Optional[str]:
    """The state-dict key (below the layer) that a layer with Laplacian heads saves with a leading axis of 1:
    the first parameter of its output projection ``proj`` (``proj.weight``; LeViT ``proj.1.linear.weight``)."""
    proj = getattr(module, "proj", None)
    name = next((n for n, _ in proj.named_parameters()), None) if isinstance(proj, nn.Module) else None
    return None if name is None else f"proj.{name}"


def _guard_state_dict(module: Any, state: Any, prefix: str, local_metadata: Any) -> None:
    # A state-dict post hook: the anchor of a layer whose forward is not timm's is saved as a view of
    # shape (1, *shape). torch refuses a shape mismatch even in a non-strict load, so a stock timm
    # model (whose loaders drop unexpected keys such as the marker when they adapt a classifier)
    # refuses the file instead of loading it standard. A view, so in-place updates through the
    # state dict (timm's ModelEmaV3) still reach the parameter. ``state_dict(keep_vars=True)`` (tracing,
    # torch.jit) asks for the module's own parameters, not a file: those stay as they are.
    anchor = anchor_of(module) if module.laplacian_active else None
    if anchor is None:
        return
    value = state.get(prefix + anchor)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        state[prefix + anchor] = state[prefix + anchor].unsqueeze(0)


def _heads_of(module: Any) -> int:
    """Number of query heads of a timm attention module (``num_heads``; Hiera calls it ``heads``)."""
    n = getattr(module, "num_heads", None)
    return int(n if n is not None else module.heads)


class LaplacianLayer(nn.Module):
    """Base of every Laplacian timm attention class ``LaplacianX(LaplacianLayer, X)``: the head selection,
    the checkpoint marker and the Laplacian core (:meth:`_laplacian_attend`)."""

    if TYPE_CHECKING:  # the mixin's other attributes are those of the timm class it is mixed into

        def __getattr__(self, name: str) -> Any: ...

    #: axis of the heads in timm's own attention matrix (``(..., H, N, N)``); read by references.
    laplacian_head_axis: int = -3

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        stock = cls.__bases__[-1]
        # LaplacianX(LaplacianLayer or a mixin of it, X) here is the twin of X; a subclass written
        # elsewhere (a user's) never replaces the twin that convert() uses
        if cls.__module__ == __name__ and not issubclass(stock, LaplacianLayer):
            LAPLACIAN_CLASSES[stock] = cls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """timm's own forward while no head is Laplacian, else the subclass's ``_laplacian_forward``."""
        if not self.laplacian_active:
            return super().forward(*args, **kwargs)
        return self._laplacian_forward(*args, **kwargs)

    @classmethod
    def laplacian_refusal(cls, module: nn.Module) -> Optional[str]:
        """Why this instance of the timm class cannot be made Laplacian (None: it can)."""
        return None

    def _init_laplacian(self, spec: Any) -> None:
        # Called by __init__ and by convert() (after a __class__ swap, where __init__ never ran).
        #: this layer's resolved selection (for learnable mixing: the heads that started Laplacian).
        self.laplacian_selection = LayerHeads((False,) * _heads_of(self))
        #: learnable mixing: lap_mix_a / lap_mix_b exist and drive the forward pass.
        self.laplacian_learnable = False
        self._register_marker()
        self.set_laplacian_heads(spec)

    def set_laplacian_heads(self, spec: Any) -> None:
        """Choose the Laplacian heads of this layer (int k, "all", "none", indices, a bool mask, or "learn...");
        a learnable spec (re)creates ``lap_mix_a`` / ``lap_mix_b``, a fixed one removes them."""
        if isinstance(spec, LaplacianHeads) and spec.kind not in ("k", "all", "none", "ablation", "learn"):
            raise ConfigError(
                f"{spec!r} is per-layer; a single {type(self).__name__} layer needs one layer's selection. "
                "Use lapheads.timm.convert(model, spec) to apply a per-layer selection to a model"
            )
        set_layer_heads(self, spec, _heads_of(self))
        if MARKER in self._buffers:  # not yet during _init_laplacian
            self._sync_marker()

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

    def laplacian_codes(self) -> list[int]:
        """This layer's heads as the marker stores them: per head 0 standard, 1 Laplacian, 2 learnable mixing,
        3 fixed mixing ``a I + b P`` (an ablation; :meth:`laplacian_coef` gives ``(a, b)``)."""
        if self.laplacian_learnable:
            return [MIX_LEARNABLE] * _heads_of(self)
        sel = self.laplacian_selection
        on = MIX_LAPLACIAN if sel.coef == LAPLACIAN else MIX_FIXED
        return [on if f else MIX_STANDARD for f in sel.flags]

    def laplacian_coef(self) -> Optional[tuple[float, float]]:
        """``(a, b)`` of this layer's fixed mixing heads; None when it has none."""
        return self.laplacian_selection.coef if MIX_FIXED in self.laplacian_codes() else None

    def laplacian_mismatch(self, name: str, codes: list[int], coef: Optional[tuple[float, float]]) -> str:
        """The refusal of a checkpoint whose marker (``codes``, ``coef``) describes other heads than this layer's."""
        return (
            f"{name or type(self).__name__}: the checkpoint has {describe_codes(codes, coef)} but this layer has "
            f"{describe_codes(self.laplacian_codes(), self.laplacian_coef())}; load it into a model with the same "
            "heads (lapheads.timm.create_model without laplacian_heads takes them from the checkpoint)"
        )

    def _register_marker(self) -> None:
        # A persistent buffer, so the key is in every state dict (torch.save, safetensors,
        # save_for_hf, distributed checkpoints) and a strict load into a stock timm layer refuses it.
        if MARKER not in self._buffers:
            device = next(self.parameters(), torch.empty(0)).device
            self.register_buffer(MARKER, torch.zeros(_heads_of(self), dtype=torch.int8, device=device))
        if _guard_state_dict not in self._state_dict_hooks.values():
            self.register_state_dict_post_hook(_guard_state_dict)

    def _sync_marker(self) -> None:
        """Write the selection into the marker (and the fixed mixing into :data:`COEF`, which exists only
        then): new tensors (no in-place write under inference mode), only when the values differ."""
        codes = self.laplacian_codes()
        old = self._buffers[MARKER]
        assert old is not None
        if old.is_meta or old.tolist() != codes:
            self._buffers[MARKER] = torch.tensor(codes, dtype=torch.int8, device=old.device)
        coef, saved = self.laplacian_coef(), self._buffers.get(COEF)
        if coef is None:
            self._buffers.pop(COEF, None)
        elif saved is None or decode_coef(saved) != coef:
            self._buffers[COEF] = encode_coef(coef, old.device)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self._sync_marker()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        _, _, missing_keys, _, error_msgs = args  # local_metadata, strict, missing, unexpected, error messages
        self._sync_marker()
        # The anchor (see _guard_state_dict) loads in either shape: (1, *shape) as saved by a layer with
        # Laplacian heads, or its own (stock timm weights, files written before the anchor was saved so).
        # torch hands each module a copy of the state dict, so the entry is replaced in that copy only.
        anchor = anchor_of(self)
        saved_anchor = state_dict.get(prefix + anchor) if anchor is not None else None
        old_format = False
        if isinstance(saved_anchor, torch.Tensor) and anchor is not None:
            own_shape = tuple(self.get_parameter(anchor).shape)
            if tuple(saved_anchor.shape) == (1, *own_shape):
                state_dict[prefix + anchor] = saved_anchor.squeeze(0)
            else:
                old_format = True
        # No marker: stock timm weights, the paper authors' checkpoints, files saved before the
        # marker existed: they load into any selection (retrofitting). A marker must match.
        key = prefix + MARKER
        saved = state_dict.get(key)
        own = self.laplacian_codes()
        if isinstance(saved, torch.Tensor) and not saved.is_meta and saved.shape == (len(own),):
            codes = [int(c) for c in saved.tolist()]
            saved_coef = state_dict.get(prefix + COEF)
            coef = decode_coef(saved_coef) if isinstance(saved_coef, torch.Tensor) else None
            # a file with Laplacian heads and an anchor of its own shape was written before fixed mixing had
            # a code of its own, when such heads were marked Laplacian: it loads into the same fixed mixing
            before = old_format and codes == [MIX_LAPLACIAN if c == MIX_FIXED else c for c in own]
            if not before and (codes != own or (MIX_FIXED in own and coef != self.laplacian_coef())):
                error_msgs.append(self.laplacian_mismatch(prefix[:-1], codes, coef))
        super()._load_from_state_dict(state_dict, prefix, *args)
        for k in (key, prefix + COEF):
            if k not in state_dict and k in missing_keys:
                missing_keys.remove(k)
        self._sync_marker()  # the buffers follow the selection, never the file

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
        """This layer's heads over ``q, k, v`` ``(..., H, N, D)``; ``attn_mask``: boolean (True = attend) or the
        summed additive biases (``is_causal`` wins over it on the eager path, timm's rule)."""
        drop = getattr(self, "attn_drop", None)
        kw: dict[str, Any] = dict(laplacian_heads=layer_operator(self), is_causal=is_causal, scale=scale)
        kw["dropout_p"] = getattr(drop, "p", 0.0) if (drop is not None and self.training) else 0.0
        if getattr(self, "fused_attn", True):
            return laplacian_attention(q, k, v, attn_mask=attn_mask, **kw)
        # Eager path: dropout acts on P only; a fully masked query row has P = 0, as when fused.
        return laplacian_attention_reference(q, k, v, attn_mask=None if is_causal else attn_mask, **kw)[0]

    def extra_repr(self) -> str:
        heads = "learnable a I + b P" if self.laplacian_learnable else list(self.laplacian_selection.indices)
        base, mine = super().extra_repr(), f"num_heads={_heads_of(self)}, laplacian_heads={heads}"
        return f"{base}, {mine}" if base else mine


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


def _window_mask(bias: torch.Tensor, mask: Optional[torch.Tensor], batch: int) -> torch.Tensor:
    """Swin's ``(nW, N, N)`` shifted-window mask added to the ``(1, H, N, N)`` bias as timm's fused branch
    does: ``(B * nW, H, N, N)`` (window w of image b is row ``b * nW + w``)."""
    if mask is None:
        return bias
    nw, n = mask.shape[0], mask.shape[-1]
    h = bias.shape[1]
    full = bias.unsqueeze(1) + mask.to(bias.dtype).view(1, nw, 1, n, n)  # (1, nW, H, N, N)
    return full.expand(batch // nw, -1, -1, -1, -1).reshape(batch, h, n, n)


class LaplacianAttention(LaplacianLayer, Attention):
    """timm ``Attention`` whose selected heads output ``V - softmax(QK^T)V``; usable as ``attn_layer=``.

    Args:
        dim: token width.
        num_heads: number of heads.
        *args: passed to ``timm.layers.Attention``.
        laplacian_heads: the heads of THIS layer that are Laplacian: an int k (trailing k heads),
            ``"all"``, ``"none"``, head indices, a boolean ``(num_heads,)`` mask or a
            :class:`lapheads.heads.LayerHeads`. ``None``: the class default ``default_laplacian_heads``
            (``"none"``; see :meth:`with_heads`).
        **kwargs: passed to ``timm.layers.Attention`` (qkv_bias, qk_norm, attn_drop, ...).
    """

    #: selection used when the constructor gets ``laplacian_heads=None`` (timm never passes it).
    default_laplacian_heads: Any = "none"
    _variants: dict[tuple[type, str], type] = {}

    def __init__(self, dim: int, num_heads: int = 8, *args: Any, laplacian_heads: Any = None, **kwargs: Any):
        super().__init__(dim, num_heads, *args, **kwargs)
        self._init_laplacian(self.default_laplacian_heads if laplacian_heads is None else laplacian_heads)

    @classmethod
    def with_heads(cls, laplacian_heads: Any) -> type["LaplacianAttention"]:
        """A subclass (cached per selection) whose default is ``laplacian_heads`` in every layer:
        ``VisionTransformer(attn_layer=LaplacianAttention.with_heads(3))``."""
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

    def _laplacian_forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        gate_layer = getattr(self, "gate", None)  # timm >= 1.0.2x: optional sigmoid output gate
        gate = gate_layer(x).sigmoid() if gate_layer is not None else None
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        q, k = self.q_norm(q), self.k_norm(k)
        scale = None if self.fused_attn else self.scale
        x = self.norm(_merge_heads(self._laplacian_attend(q, k, v, attn_mask, is_causal=is_causal, scale=scale)))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class _LaplacianRope(LaplacianLayer):
    """EVA's attention and ``AttentionRope``: RoPE on the non-prefix tokens, sub-LN, gate."""

    def _laplacian_forward(
        self,
        x: torch.Tensor,
        rope: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
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


class LaplacianEvaAttention(_LaplacianRope, EvaAttention):
    """``timm.models.eva.EvaAttention`` with Laplacian heads (EVA, EVA-02, DINOv3, timm's RoPE ViTs)."""


class LaplacianAttentionRope(_LaplacianRope, AttentionRope):
    """``timm.layers.AttentionRope`` with Laplacian heads (RoPE-ViT, EVA ``attn_type='rope'``, Qwen3 / DeepSeek ViT)."""


class LaplacianBeitAttention(LaplacianLayer, BeitAttention):
    """``timm.models.beit.Attention`` with Laplacian heads: q/v biases, own and shared relative position bias."""

    def _laplacian_forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = _split_heads(_biased_qkv(self, x), self.num_heads)
        bias = self._get_rel_pos_bias() if self.relative_position_bias_table is not None else None
        if shared_rel_pos_bias is not None:
            bias = shared_rel_pos_bias if bias is None else bias + shared_rel_pos_bias
        x = _merge_heads(self._laplacian_attend(q, k, v, mask_like(bias, q)))
        return self.proj_drop(self.proj(x))


class LaplacianSwinWindowAttention(LaplacianLayer, SwinWindowAttention):
    """Swin's ``WindowAttention`` with Laplacian heads: per window, relative position bias, shifted-window mask."""

    def _laplacian_forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        bias = _window_mask(self._get_rel_pos_bias(), mask, x.shape[0])
        x = _merge_heads(
            self._laplacian_attend(q, k, v, mask_like(bias, q), scale=None if self.fused_attn else self.scale)
        )
        return self.proj_drop(self.proj(x))


def _swinv2_position_bias(m: Any) -> torch.Tensor:
    """Swin v2's continuous position bias ``16 * sigmoid(cpb_mlp(coords))`` gathered to ``(1, H, N, N)``."""
    n = m.window_size[0] * m.window_size[1]
    table = m.cpb_mlp(m.relative_coords_table).view(-1, m.num_heads)
    bias = table[m.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
    return (16 * torch.sigmoid(bias)).unsqueeze(0)


class LaplacianSwinV2WindowAttention(LaplacianLayer, SwinV2WindowAttention):
    """Swin v2's ``WindowAttention`` with Laplacian heads: cosine attention, continuous position bias, window mask."""

    def _laplacian_forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = _split_heads(_biased_qkv(self, x), self.num_heads)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()  # (H, 1, 1), timm's clamp
        q, k = F.normalize(q, dim=-1) * logit_scale, F.normalize(k, dim=-1)
        bias = _window_mask(_swinv2_position_bias(self), mask, x.shape[0])
        x = _merge_heads(self._laplacian_attend(q, k, v, mask_like(bias, q), scale=1.0))
        return self.proj_drop(self.proj(x))


class LaplacianRelPosAttention(LaplacianLayer, RelPosAttention):
    """``RelPosAttention`` (RelPos ViT) with Laplacian heads: its own ``rel_pos`` bias, else the shared one."""

    def _laplacian_forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        q, k = self.q_norm(q), self.k_norm(k)
        rel_pos: Any = self.rel_pos
        bias = rel_pos.get_bias() if rel_pos is not None else shared_rel_pos
        x = _merge_heads(
            self._laplacian_attend(q, k, v, mask_like(bias, q), scale=None if self.fused_attn else self.scale)
        )
        return self.proj_drop(self.proj(x))


class LaplacianMaskUnitAttention(LaplacianLayer, MaskUnitAttention):
    """Hiera's ``MaskUnitAttention`` with Laplacian heads, mask-unit or global (query-pooling layers are refused)."""

    @classmethod
    def laplacian_refusal(cls, module: nn.Module) -> Optional[str]:
        stride = int(getattr(module, "q_stride", 1))
        if stride > 1:
            return f"pools its queries (q_stride={stride}), so a query is no token among the keys and has no own value"
        return None

    @property
    def laplacian_head_axis(self) -> int:  # type: ignore[override]
        return -4 if self.use_mask_unit_attn else -3  # timm's (B, H, windows, N, N) vs (B, H, N, N)

    def _laplacian_forward(self, x: torch.Tensor) -> torch.Tensor:
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


class LaplacianLevitAttention(LaplacianLayer, LevitAttention):
    """LeViT's ``Attention`` with Laplacian heads: learned attention biases, linear or conv layout."""

    def _laplacian_forward(self, x: torch.Tensor) -> torch.Tensor:
        split = [self.key_dim, self.key_dim, self.val_dim]
        bias = self.get_attention_biases(x.device)  # (H, N, N)
        if self.use_conv:
            B, _, H, W = x.shape
            q, k, v = (t.transpose(-2, -1) for t in self.qkv(x).view(B, self.num_heads, -1, H * W).split(split, dim=2))
            out = self._laplacian_attend(q, k, v, mask_like(bias, q), scale=self.scale)
            x = out.transpose(-2, -1).reshape(B, -1, H, W)
        else:
            B, N, _ = x.shape
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, N, self.num_heads, -1).split(split, dim=3))
            out = self._laplacian_attend(q, k, v, mask_like(bias, q), scale=self.scale)
            x = out.transpose(1, 2).reshape(B, N, self.val_attn_dim)
        return self.proj(x)


class _LaplacianPlainQKV(LaplacianLayer):
    """Attention that is one fused q/k/v projection, SDPA and an output projection (nothing else)."""

    def _laplacian_forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _split_heads(self.qkv(x), self.num_heads)
        x = self.proj(_merge_heads(self._laplacian_attend(q, k, v, scale=None if self.fused_attn else self.scale)))
        drop = getattr(self, "proj_drop", None)
        return drop(x) if drop is not None else x


class LaplacianMetaFormerAttention(_LaplacianPlainQKV, MetaFormerAttention):
    """MetaFormer's ``Attention`` (CAFormer's attention stages) with Laplacian heads."""


class LaplacianDavitWindowAttention(_LaplacianPlainQKV, DavitWindowAttention):
    """DaViT's spatial ``WindowAttention`` with Laplacian heads (its channel attention stays standard)."""


class LaplacianMaxxVitAttention2d(LaplacianLayer, MaxxVitAttention2d):
    """MaxxViT's ``Attention2d`` (NCHW, CoAtNet-style blocks) with Laplacian heads."""

    def _laplacian_forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, _, H, W = x.shape
        if self.head_first:
            q, k, v = self.qkv(x).view(B, self.num_heads, self.dim_head * 3, -1).chunk(3, dim=2)
        else:
            q, k, v = self.qkv(x).reshape(B, 3, self.num_heads, self.dim_head, -1).unbind(1)
        q, k, v = q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)  # (B, H, N, D)
        rel_pos: Any = self.rel_pos
        bias = rel_pos.get_bias() if rel_pos is not None else shared_rel_pos
        out = self._laplacian_attend(q, k, v, mask_like(bias, q), scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(-1, -2).reshape(B, -1, H, W)))


class LaplacianMaxxVitAttentionCl(LaplacianLayer, MaxxVitAttentionCl):
    """MaxxViT's channels-last ``AttentionCl`` (MaxViT's block and grid partitions) with Laplacian heads."""

    def _laplacian_forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, shape = x.shape[0], x.shape[:-1]
        if self.head_first:
            q, k, v = self.qkv(x).view(B, -1, self.num_heads, self.dim_head * 3).transpose(1, 2).chunk(3, dim=3)
        else:
            q, k, v = self.qkv(x).reshape(B, -1, 3, self.num_heads, self.dim_head).transpose(1, 3).unbind(2)
        rel_pos: Any = self.rel_pos
        bias = rel_pos.get_bias() if rel_pos is not None else shared_rel_pos
        out = self._laplacian_attend(q, k, v, mask_like(bias, q), scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(shape + (-1,))))
