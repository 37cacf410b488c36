"""Laplacian heads in timm Vision Transformers (timm >= 1.0.23, unmodified).

What this module gives:

* :class:`LaplacianAttention`, a subclass of ``timm.layers.Attention`` usable as ``attn_layer=`` of
  timm's ``VisionTransformer`` / ``Block``. The selected heads output ``V - P V`` instead of
  ``P V`` (PAPER.md, "The operator").
* :func:`convert` turns every ``timm.layers.Attention`` of an existing model into a
  :class:`LaplacianAttention` IN PLACE, by swapping the instance's class: no parameter is created,
  copied or re-initialised, so pretrained weights, optimizer references and ``state_dict`` keys are
  all unchanged.
* :func:`create_model` = ``timm.create_model`` + :func:`convert`, for any timm ViT.
* Registered timm names for the paper's variants (see "Naming scheme" below), created by
  ``timm.create_model`` once ``lapheads.timm`` has been imported.

Design choices:

* A layer's selection is ``laplacian_selection``, a :class:`lapheads.heads.LayerHeads` (Python
  bools, resolved once; see its docstring for why not a tensor), set by
  :meth:`LaplacianAttention.set_laplacian_heads`. It is a plain attribute, neither a parameter nor
  a buffer, so the ``state_dict`` keys are timm's: timm checkpoints load into converted models and
  converted checkpoints load into plain timm models. ``forward`` picks its code path from it, hands
  it to :func:`lapheads.laplacian_attention` as is (fused path), and applies it by slicing
  (:func:`lapheads.ops.subtract_selected`, eager path), so neither path touches a device mask and
  ``torch.compile(fullgraph=True)`` works. The selection that rebuilds the model is stored as
  ``model.laplacian_heads`` (a :class:`lapheads.LaplacianHeads`) and
  ``model.pretrained_cfg["laplacian_heads"]`` (plain JSON); a saved run records it in its config.
* A layer with no Laplacian head runs timm's own ``Attention.forward`` unchanged, so the k = 0 model
  is bit-identical to timm on both paths and costs nothing extra.
* Fused path (``fused_attn=True``, timm's default): :func:`lapheads.laplacian_attention` (one SDPA
  call, then ``v - out`` on the selected heads). Eager path (``fused_attn=False``): timm's explicit
  softmax, ``attn_drop`` applied to P only (the identity term is never dropped), then
  ``v - P v`` on the selected heads. On both paths a query row whose mask hides every key has
  ``P = 0`` (the operator's rule, :mod:`lapheads.ops`), so its Laplacian heads output ``v``; the
  eager softmax runs in float32 for that (:func:`lapheads.ops.masked_softmax`). A layer with no
  Laplacian head is timm's own code, where such a row is NaN on the eager path. ``qk_norm``, ``scale_norm`` (``self.norm``), timm's output
  gate (``gated=True``, newer timm), ``attn_mask`` and ``is_causal`` behave exactly as in timm.
* timm builds every block's ``attn_layer`` with the same keyword arguments and never tells it its
  depth, so a class can only carry a selection that is the same in every layer: use
  ``LaplacianAttention.with_heads(k)`` (a cached subclass whose default is k) as ``attn_layer``, or
  build the model plainly and call :func:`convert`, which also takes per-layer selections.
* Learnable mixing (``"learn"``, ``"learn:laplacian"``, ``"learn:<k>"``, issue 13): every
  converted layer gets two parameters ``lap_mix_a`` / ``lap_mix_b`` of shape ``(num_heads,)`` and
  head h applies ``a_h I + b_h P`` on both paths (fused: :class:`lapheads.HeadMix` through the
  operator; eager: ``a * v + b * (P v)``). Unlike a fixed selection these ARE in the
  ``state_dict`` (``blocks.<i>.attn.lap_mix_a``), so a learnable model saves and restores its mixing;
  loading a plain timm checkpoint into it needs ``strict=False`` (the mixing keeps its
  initialisation). Switching a layer back to a fixed selection removes the parameters.
* Only modules whose class is exactly ``timm.layers.Attention`` (or already Laplacian) are
  converted; other attention classes (``AttentionRope`` in EVA, attention pooling heads) are left
  alone. A model with no convertible attention is refused with a :class:`ConfigError`.

Naming scheme of the registered variants: ``<timm base name>_lap<k>`` = the timm model with the
TRAILING k heads of EVERY layer Laplacian (the authors' convention), for the DeiT-3 ViT-S/B/L at
patch 16 / 224 px and every k from 1 to the number of heads:

    deit3_small_patch16_224_lap1 .. _lap6     (ViT-S, 6 heads; the paper's "ViT-S-5L" is _lap5)
    deit3_base_patch16_224_lap1  .. _lap12    (ViT-B, 12 heads; "ViT-B-12L" is _lap12)
    deit3_large_patch16_224_lap1 .. _lap16    (ViT-L, 16 heads)

The baseline (k = 0) is the plain timm name. A dotted name such as ``deit3_base_patch16_224.lap12``
is deliberately NOT used: timm reads the part after the dot as a pretrained-weight tag. No weights
exist for these variants, so ``pretrained=True`` raises a :class:`ConfigError`; to start from
DeiT-3 weights use ``create_model("deit3_base_patch16_224", pretrained=True, laplacian_heads=12)``.
Other image sizes / class counts are timm keyword arguments (``img_size=192, num_classes=100``).
"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any, Optional

import timm
import torch
from timm.layers import Attention
from torch import nn

from .errors import ConfigError
from .heads import (HeadMix, HeadSpec, LaplacianHeads, LayerHeads, laplacianness, learnable_spec, nearer_laplacian,
                    register_mix,
                    remove_mix)
from .ops import laplacian_attention, masked_softmax, subtract_selected

__all__ = [
    "LaplacianAttention",
    "convert",
    "create_model",
    "laplacian_head_counts",
    "laplacian_attention_layers",
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


class LaplacianAttention(Attention):
    """timm ``Attention`` whose selected heads output ``V - softmax(QK^T)V``.

    Same constructor as ``timm.layers.Attention`` plus ``laplacian_heads``.

    Args:
        dim: token width.
        num_heads: number of heads.
        *args: passed to ``timm.layers.Attention``.
        laplacian_heads: the heads of THIS layer that are Laplacian: an int k (trailing k heads),
            ``"all"``, ``"none"``, a list of head indices, a boolean mask of shape
            ``(num_heads,)`` or a :class:`lapheads.heads.LayerHeads`. ``None`` uses the class default ``default_laplacian_heads``
            (``"none"`` here; see :meth:`with_heads`).
        **kwargs: passed to ``timm.layers.Attention`` (qkv_bias, qk_norm, attn_drop, proj_drop,
            norm_layer, scale_norm, ...).
    """

    #: selection used when the constructor gets ``laplacian_heads=None`` (timm never passes it).
    default_laplacian_heads: Any = "none"
    _variants: dict[tuple[type, str], type] = {}

    def __init__(self, dim: int, num_heads: int = 8, *args: Any, laplacian_heads: Any = None, **kwargs: Any):
        super().__init__(dim, num_heads, *args, **kwargs)
        self._init_laplacian(self.default_laplacian_heads if laplacian_heads is None else laplacian_heads)

    # ------------------------------------------------------------------ head selection
    def _init_laplacian(self, spec: Any) -> None:
        # Called by __init__ and by convert() (after a __class__ swap, where __init__ never ran).
        #: this layer's resolved selection (for learnable mixing: the heads that started Laplacian).
        self.laplacian_selection = LayerHeads((False,) * self.num_heads)
        #: learnable mixing: lap_mix_a / lap_mix_b exist and drive the forward pass.
        self.laplacian_learnable = False
        self.set_laplacian_heads(spec)

    def set_laplacian_heads(self, spec: Any) -> None:
        """Choose the Laplacian heads of this layer (int k, "all", "none", indices, a bool mask, or "learn...").

        A learnable spec (re)creates ``lap_mix_a`` / ``lap_mix_b`` at their initialisation; a fixed
        one removes them.
        """
        learn = learnable_spec(spec)
        if learn is not None:
            selection = learn.init_selection(1, self.num_heads)[0]
            register_mix(self, selection)
            self.laplacian_selection, self.laplacian_learnable = selection, True
            return
        if isinstance(spec, LaplacianHeads) and spec.kind not in ("k", "all", "none"):
            raise ConfigError(
                f"{spec!r} is per-layer; a single LaplacianAttention layer needs one layer's selection. "
                "Use lapheads.timm.convert(model, spec) to apply a per-layer selection to a model")
        # Validate and resolve once (a tensor spec is read back here, once, not per call).
        selection = LayerHeads.of(spec, self.num_heads)
        remove_mix(self)
        self.laplacian_selection, self.laplacian_learnable = selection, False

    @property
    def num_laplacian_heads(self) -> int:
        """Number of Laplacian heads in this layer (learnable: heads now nearer Laplacian than standard)."""
        if self.laplacian_learnable:
            return sum(nearer_laplacian(laplacianness(float(a), float(b)))
                       for a, b in zip(self.lap_mix_a.tolist(), self.lap_mix_b.tolist()))
        return self.laplacian_selection.count

    @classmethod
    def with_heads(cls, laplacian_heads: Any) -> type["LaplacianAttention"]:
        """A subclass whose default selection is ``laplacian_heads`` (same for every layer).

        Use it where timm wants a class: ``VisionTransformer(attn_layer=LaplacianAttention.with_heads(3))``.
        The class is cached per selection, so repeated calls return the same class.
        """
        spec = LaplacianHeads(laplacian_heads)
        if spec.kind not in ("k", "all", "none", "learn"):
            raise ConfigError(
                f"LaplacianAttention.with_heads({laplacian_heads!r}): timm builds every layer with the same "
                "arguments, so only an int k, 'all' or 'none' fits here; use lapheads.timm.convert for per-layer heads")
        key = (cls, str(spec.spec))
        if key not in cls._variants:
            name = f"{cls.__name__}_{str(spec.spec).replace(':', '_')}"
            cls._variants[key] = type(name, (cls,), {"default_laplacian_heads": spec.spec, "__module__": __name__})
        return cls._variants[key]

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if not (self.laplacian_learnable or self.laplacian_selection.any):
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, _ = x.shape
        gate_layer = getattr(self, "gate", None)  # timm >= 1.0.2x: optional sigmoid output gate
        gate = gate_layer(x).sigmoid() if gate_layer is not None else None
        attn_dim = getattr(self, "attn_dim", self.num_heads * self.head_dim)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = laplacian_attention(
                q, k, v,
                laplacian_heads=(HeadMix(self.lap_mix_a, self.lap_mix_b) if self.laplacian_learnable
                                 else self.laplacian_selection),
                attn_mask=attn_mask,
                is_causal=is_causal,
                dropout_p=self.attn_drop.p if self.training else 0.0,
            )
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if is_causal:  # timm's convention: is_causal wins over attn_mask
                attn = attn + attn.new_full((N, N), float("-inf")).triu_(1)
            elif attn_mask is not None:
                if attn_mask.dtype == torch.bool:
                    attn = attn.masked_fill(~attn_mask, float("-inf"))
                else:
                    attn = attn + attn_mask
            # Dropout on P only. masked_softmax: a fully masked query row has P = 0 (not NaN), as on
            # the fused path (lapheads.ops, "Edge cases").
            attn = self.attn_drop(masked_softmax(attn, dim=-1))
            x = attn @ v
            if self.laplacian_learnable:
                x = (self.lap_mix_a.to(x.dtype).view(-1, 1, 1) * v
                     + self.lap_mix_b.to(x.dtype).view(-1, 1, 1) * x)
            else:
                x = subtract_selected(x, v, self.laplacian_selection)
        x = x.transpose(1, 2).reshape(B, N, attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    def extra_repr(self) -> str:
        if self.laplacian_learnable:
            return f"num_heads={self.num_heads}, laplacian_heads=learnable a I + b P"
        return f"num_heads={self.num_heads}, laplacian_heads={list(self.laplacian_selection.indices)}"


# ---------------------------------------------------------------------- model-level helpers
def laplacian_attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """``(name, module)`` of every convertible attention layer, in forward (block) order."""
    return [(n, m) for n, m in model.named_modules() if type(m) is Attention or isinstance(m, LaplacianAttention)]


def laplacian_head_counts(model: nn.Module) -> list[int]:
    """Number of Laplacian heads in each attention layer of ``model`` (0 for a plain timm layer)."""
    return [m.num_laplacian_heads if isinstance(m, LaplacianAttention) else 0
            for _, m in laplacian_attention_layers(model)]


def convert(model: nn.Module, laplacian_heads: HeadSpec) -> nn.Module:
    """Turn the attention of a timm ViT into Laplacian attention, in place, keeping every weight.

    A fixed selection creates no parameter; a learnable one (``"learn..."``) adds ``lap_mix_a`` /
    ``lap_mix_b`` to every converted layer (create the optimizer after converting).

    Args:
        model: a timm model whose blocks use ``timm.layers.Attention`` (ViT, DeiT, DeiT-3, ...);
            already converted layers are re-selected.
        laplacian_heads: anything :class:`lapheads.LaplacianHeads` accepts: int k (trailing k heads
            of every layer), ``"all"``, ``"none"``, a per-layer list of counts or of head indices.
            Validated against the model before anything is changed.

    Returns:
        the same ``model`` object, with ``model.laplacian_heads`` set to the selection.
    """
    spec = LaplacianHeads(laplacian_heads)
    layers = laplacian_attention_layers(model)
    if not layers:
        kinds = sorted({type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()})
        raise ConfigError(
            f"{type(model).__name__} has no timm.layers.Attention layer to convert"
            + (f" (it has {', '.join(kinds)}, which lapheads does not convert)" if kinds else "")
            + "; use a timm ViT family model (vit_*, deit_*, deit3_*)")
    # Resolve every layer first (each with its own head count) so a bad spec changes nothing.
    masks: list[Any] = [spec.init_selection(len(layers), m.num_heads)[i] for i, (_, m) in enumerate(layers)]
    if spec.learnable:
        masks = [spec] * len(layers)  # each layer registers its (a, b) at the spec's initialisation
    for (_, m), mask in zip(layers, masks):
        if isinstance(m, LaplacianAttention):
            m.set_laplacian_heads(mask)
        else:
            # Class swap: LaplacianAttention adds no parameter, so the module keeps its tensors.
            m.__class__ = LaplacianAttention
            m._init_laplacian(mask)
    model.laplacian_heads = spec
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        model.pretrained_cfg = dict(cfg, laplacian_heads=spec.to_config())
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
    """Create a timm ViT with Laplacian heads.

    Args:
        name: any timm model name whose blocks use ``timm.layers.Attention`` (``vit_small_patch16_224``,
            ``deit3_base_patch16_224``, ``deit3_base_patch16_224.fb_in1k``, ...), or a registered
            variant ``<base>_lap<k>`` (k then comes from the name).
        laplacian_heads: the selection (see :func:`convert`); ``None`` = none, or k from a
            ``_lap<k>`` name. Giving both a ``_lap<k>`` name and a different selection is an error.
        **timm_kwargs: passed to ``timm.create_model`` (``pretrained``, ``num_classes``,
            ``img_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``, ``qk_norm``,
            ``drop_path_rate``, ``init_values``, ...).

    Returns:
        the converted model; ``model.laplacian_heads`` holds the selection.
    """
    base, k = _split_lap_name(name)
    if k is not None:
        if laplacian_heads is not None and LaplacianHeads(laplacian_heads) != LaplacianHeads(k):
            raise ConfigError(
                f"model name {name!r} means laplacian_heads={k}, but laplacian_heads={laplacian_heads!r} was "
                f"also given; use the base name {base!r} with laplacian_heads, or drop laplacian_heads")
        laplacian_heads = k
        if timm_kwargs.get("pretrained"):
            raise _no_pretrained(name, base, k)
    spec = LaplacianHeads(laplacian_heads)  # validate the type before building anything
    if not timm.is_model(base):
        raise _unknown_model(name)
    model = timm.create_model(base, **timm_kwargs)
    try:
        return convert(model, spec)
    except ConfigError as e:
        raise ConfigError(f"model {name!r}: {e}") from None


# ---------------------------------------------------------------------- timm registration
def _no_pretrained(name: str, base: str, k: int) -> ConfigError:
    return ConfigError(
        f"no pretrained weights exist for {name!r}; use pretrained=False, or start from the baseline weights "
        f"with lapheads.timm.create_model({base!r}, pretrained=True, laplacian_heads={k})")


def _make_entrypoint(base: str, k: int):
    name = f"{base}_lap{k}"

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        if pretrained:
            raise _no_pretrained(name, base, k)
        # timm.create_model hands these to every entrypoint; they describe weights we do not have.
        for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
            kwargs.pop(key, None)
        model = timm.models.model_entrypoint(base)(pretrained=False, **kwargs)
        convert(model, k)
        model.pretrained_cfg = dict(model.pretrained_cfg, architecture=name, tag=None, hf_hub_id=None,
                                    url="", file=None, laplacian_heads=k)
        return model

    entrypoint.__name__ = name
    entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"timm {base} with the trailing {k} heads of every layer Laplacian (no pretrained weights)."
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
