"""lapheads: Laplacian heads for Transformers.

A Laplacian head outputs ``V - softmax(QK^T)V`` instead of ``softmax(QK^T)V`` (Zhang & Papyan,
"Laplacian Heads Improve Transformers by Smoothing Token Representations", 2026). This package
provides the operator, drop-in integrations for torch, timm and transformers, training recipes
for the paper's three experiments, and a toolkit that measures token geometry.
"""

from .errors import CheckpointError, ConfigError, DataError, LapheadsError
from .heads import HeadMix, LaplacianHeads, LayerHeads, head_mask, mixing_table, suggest_selection
from .ops import laplacian_attention, laplacian_attention_reference

__version__ = "0.2.0"

__all__ = [
    "LaplacianHeads",
    "LayerHeads",
    "HeadMix",
    "head_mask",
    "mixing_table",
    "suggest_selection",
    "laplacian_attention",
    "laplacian_attention_reference",
    "LapheadsError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "__version__",
]
