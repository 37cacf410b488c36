"""Token geometry: ANOVA, Neural Collapse, linguistic collapse, spectra and cosine, per layer.

In-memory functions (one tensor in, a dict of floats out)::

    from lapheads.geometry import anova, neural_collapse, cdnv, spectral_k99, within_sequence_cosine

Streaming accumulators with the same numbers batch by batch (mergeable, all-reducible,
resumable): :class:`GeometryAccumulator` (everything for one layer) and its parts
:class:`AnovaAccumulator`, :class:`ClassAccumulator`, :class:`NC4Accumulator`,
:class:`SpectraAccumulator`, :class:`CosineAccumulator`.

Capture from models (:func:`analyze_model`, ``kind="vit" | "hf" | "hooks"``) lives in
:mod:`lapheads.geometry.capture` and plots in :mod:`lapheads.geometry.plots`; both are imported
lazily so ``import lapheads.geometry`` stays light.
"""

from .measures import (
    anova,
    cdnv,
    geometry,
    neural_collapse,
    pca_rgb,
    spectra,
    spectral_k99,
    within_sequence_cosine,
)
from .streaming import (
    AnovaAccumulator,
    ClassAccumulator,
    CosineAccumulator,
    GeometryAccumulator,
    NC4Accumulator,
    SpectraAccumulator,
)

__all__ = [
    "anova", "cdnv", "geometry", "neural_collapse", "pca_rgb", "spectra", "spectral_k99",
    "within_sequence_cosine", "AnovaAccumulator", "ClassAccumulator", "CosineAccumulator",
    "GeometryAccumulator", "NC4Accumulator", "SpectraAccumulator", "analyze_model",
    "save_geometry_json",
]


def __getattr__(name: str):  # lazy: capture imports timm / transformers only when used
    if name in ("analyze_model", "save_geometry_json"):
        from . import capture
        return getattr(capture, name)
    raise AttributeError(name)
