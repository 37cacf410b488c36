"""Laplacian heads in timm models (timm >= 1.0.23, unmodified).

:func:`create_model` is ``timm.create_model`` + :func:`convert`, and reloads saved Laplacian models
(a file, ``local-dir:``, ``hf-hub:``) with their heads. :func:`convert` turns every convertible
attention module into its Laplacian twin IN PLACE, weights and ``state_dict`` keys kept (plus one
marker buffer, ``lap_heads``, per layer, and the output projection's weight saved with a leading axis
of 1, which plain timm refuses); :func:`stock_state_dict` gives the weights in stock form;
:func:`skipped_attention_layers` says which stay standard.
``import lapheads.timm`` registers ``<timm name>_lap<k>`` (:data:`VARIANT_BASES`: the trailing k heads
of every layer Laplacian, no weights; the paper's "ViT-S-5L" is ``deit3_small_patch16_224_lap5``).
"""

from __future__ import annotations

try:
    import timm as _timm  # noqa: F401 - only to name the missing package
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "lapheads.timm needs timm, which is not installed: pip install timm (or lapheads[train])", name=e.name
    ) from None

from ._checkpoints import _LAPLACIAN_KEY as _LAPLACIAN_KEY  # noqa: F401 - reached by the tests
from ._checkpoints import REGISTERED_MODELS, VARIANT_BASES, create_model, register_variants, stock_state_dict
from ._convert import REFUSED_CLASSES as REFUSED_CLASSES
from ._convert import convert, laplacian_attention_layers, laplacian_head_counts, skipped_attention_layers
from ._layers import (
    LAPLACIAN_CLASSES,
    LaplacianAttention,
    LaplacianAttentionRope,
    LaplacianBeitAttention,
    LaplacianDavitWindowAttention,
    LaplacianEvaAttention,
    LaplacianLayer,
    LaplacianLevitAttention,
    LaplacianMaskUnitAttention,
    LaplacianMaxxVitAttention2d,
    LaplacianMaxxVitAttentionCl,
    LaplacianMetaFormerAttention,
    LaplacianRelPosAttention,
    LaplacianSwinV2WindowAttention,
    LaplacianSwinWindowAttention,
)
from ._layers import _heads_of as _heads_of  # noqa: F401 - reached by the tests

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
    "stock_state_dict",
    "laplacian_head_counts",
    "laplacian_attention_layers",
    "skipped_attention_layers",
    "REGISTERED_MODELS",
    "VARIANT_BASES",
]

register_variants()
