"""Laplacian heads for Hugging Face ``transformers`` (5.x) models, with no fork of the model code.

``import lapheads.transformers`` registers three attention implementations in transformers'
``AttentionInterface``: :data:`ATTN_IMPLEMENTATION` (fused), :data:`FUSED_ATTN_IMPLEMENTATION` (the
same for model classes without SDPA support) and :data:`EAGER_ATTN_IMPLEMENTATION` (returns the
operator as the attention weights). :func:`enable` gives a model Laplacian heads;
``save_pretrained`` / ``push_to_hub`` write a checkpoint that transformers alone refuses (its own model type,
registered here for every model type transformers knows) and :func:`from_pretrained` loads it back, never
silently as a standard model (more: docs/integrations.md, docs/sharing.md).
"""

from __future__ import annotations

try:
    from transformers import AttentionInterface as _AttentionInterface  # noqa: F401 - transformers >= 5
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "lapheads.transformers needs transformers, which is not installed: "
        "pip install 'transformers>=5' (or lapheads[train])",
        name=e.name,
    ) from None
except ImportError as e:  # pragma: no cover - transformers is a hard dependency
    raise ImportError("lapheads.transformers needs transformers >= 5.0 (pip install 'transformers>=5')") from e

# reached by the tests under these names (not part of the public API, which is __all__)
from ..heads import MIX_PARAM_SUFFIXES as MIX_PARAM_SUFFIXES
from ._attention import laplacian_eager_attention_forward, laplacian_sdpa_attention_forward, register_implementations
from ._configs import check_implementation, fused_implementation, layer_selections
from ._extras import flex_softcap_pv as _flex_softcap_pv  # noqa: F401 - reached by the tests
from ._indexing import attention_modules, mixing_modules
from ._loading import enable, from_pretrained
from ._names import (
    ATTN_IMPLEMENTATION,
    EAGER_ATTN_IMPLEMENTATION,
    FUSED_ATTN_IMPLEMENTATION,
    INDEXED_ATTN_IMPLEMENTATION_SUFFIX,
    SAVED_ATTN_IMPLEMENTATION,
    SAVED_EAGER_ATTN_IMPLEMENTATION,
    SAVED_FUSED_ATTN_IMPLEMENTATION,
    is_laplacian_implementation,
)
from ._registry import LaplacianCheckpointConfig, register_model_types
from ._saving import mark_config

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FUSED_ATTN_IMPLEMENTATION",
    "EAGER_ATTN_IMPLEMENTATION",
    "SAVED_ATTN_IMPLEMENTATION",
    "SAVED_FUSED_ATTN_IMPLEMENTATION",
    "SAVED_EAGER_ATTN_IMPLEMENTATION",
    "INDEXED_ATTN_IMPLEMENTATION_SUFFIX",
    "check_implementation",
    "is_laplacian_implementation",
    "fused_implementation",
    "mark_config",
    "laplacian_sdpa_attention_forward",
    "laplacian_eager_attention_forward",
    "enable",
    "from_pretrained",
    "layer_selections",
    "mixing_modules",
    "attention_modules",
    "LaplacianCheckpointConfig",
]

register_implementations()
register_model_types()
