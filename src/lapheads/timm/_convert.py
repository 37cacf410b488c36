"""Converting a timm model in place, and which attention layers stay standard (and why)."""

from __future__ import annotations

import inspect
import re
from typing import Any, cast

from torch import nn

from ..errors import ConfigError
from ..heads import HeadSpec, LaplacianHeads, LayerHeads
from ._layers import LAPLACIAN_CLASSES, LaplacianLayer, _heads_of

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

    Attention is a class lapheads converts (which may refuse the instance), one in
    :data:`REFUSED_CLASSES`, or one named like attention or whose ``forward`` calls a softmax or
    SDPA, unless it only wraps such a module (a block).
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
    """One selection per layer, each validated against ITS head count (hierarchical models widen per stage)."""
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

    Attention of other classes stays standard (:func:`skipped_attention_layers` says why). A learnable
    setting adds ``lap_mix_a`` / ``lap_mix_b`` to every converted layer: create the optimizer after.

    Args:
        model: a timm model with convertible attention (ViT, DeiT-3, EVA, DINOv3, BEiT, Swin, Hiera,
            LeViT, MaxViT, ...); already converted layers are re-selected.
        laplacian_heads: anything :class:`lapheads.LaplacianHeads` accepts, per-layer lists with one
            entry per layer of :func:`laplacian_attention_layers`; validated before anything changes.

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
    # Resolve every layer first so a bad spec changes nothing.
    masks: list[Any] = _layer_selections(spec, [_heads_of(m) for _, m in layers])
    if spec.learnable:
        masks = [spec] * len(layers)  # each layer registers its (a, b) at the spec's initialisation
    for (_, m), mask in zip(layers, masks):
        if isinstance(m, LaplacianLayer):
            m.set_laplacian_heads(mask)
        else:
            m.__class__ = LAPLACIAN_CLASSES[type(m)]
            cast(Any, m)._init_laplacian(mask)
    # plain attributes, not submodules: object.__setattr__ keeps nn.Module's typed __setattr__ out
    object.__setattr__(model, "laplacian_heads", spec)
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        object.__setattr__(model, "pretrained_cfg", dict(cfg, laplacian_heads=spec.to_config()))
    return model
