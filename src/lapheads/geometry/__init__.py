"""Token geometry: ANOVA, Neural Collapse, linguistic collapse, spectra and cosine, per layer.

In-memory functions (one tensor in, a dict of floats out)::

    from lapheads.geometry import anova, neural_collapse, cdnv, spectral_k99, within_sequence_cosine

Streaming accumulators with the same numbers batch by batch (mergeable, all-reducible,
resumable): :class:`GeometryAccumulator` (everything for one layer) and its parts
:class:`AnovaAccumulator`, :class:`ClassAccumulator`, :class:`NC4Accumulator`,
:class:`SpectraAccumulator`, :class:`CosineAccumulator`.

Capture from models (:func:`analyze_model`, ``kind="vit" | "hf" | "hooks"``, one small adapter
per kind) lives in :mod:`lapheads.geometry.capture`. The package depends on torch and numpy only:
the adapters duck-type timm and transformers models instead of importing them. Plots
(:mod:`lapheads.geometry.plots`, matplotlib) are imported only by those who draw.

Modules: ``measures`` (in-memory functions), ``accumulate`` (the base accumulator), ``variance`` (ANOVA),
``classes`` (NC, CDNV, NC4), ``sequences`` (spectra, cosine), ``streaming`` (one layer's
:class:`GeometryAccumulator`; re-exports the others), ``capture`` (models -> accumulators).
"""

from .capture import analyze_model, save_geometry_json
from .measures import anova, cdnv, geometry, neural_collapse, pca_rgb, spectra, spectral_k99, within_sequence_cosine
from .streaming import (
    AnovaAccumulator,
    ClassAccumulator,
    CosineAccumulator,
    GeometryAccumulator,
    NC4Accumulator,
    SpectraAccumulator,
)

__all__ = [
    "anova",
    "cdnv",
    "geometry",
    "neural_collapse",
    "pca_rgb",
    "spectra",
    "spectral_k99",
    "within_sequence_cosine",
    "AnovaAccumulator",
    "ClassAccumulator",
    "CosineAccumulator",
    "GeometryAccumulator",
    "NC4Accumulator",
    "SpectraAccumulator",
    "analyze_model",
    "save_geometry_json",
]
