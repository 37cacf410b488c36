"""Token geometry: ANOVA, Neural Collapse, linguistic collapse, spectra and cosine, per layer.

In-memory functions (one tensor in, a dict of floats out; :mod:`~lapheads.geometry.measures`),
streaming accumulators with the same numbers batch by batch (mergeable, all-reducible, resumable;
:class:`GeometryAccumulator` for one layer, and its parts), and capture from models
(:func:`analyze_model`, ``kind="vit" | "hf" | "hooks"``). The package depends on torch and numpy
only; plots (:mod:`lapheads.geometry.plots`, matplotlib) are imported only by those who draw.
"""

from .capture import analyze_model, save_geometry_json
from .classes import ClassAccumulator, NC4Accumulator
from .measures import anova, cdnv, geometry, neural_collapse, pca_rgb, spectra, spectral_k99, within_sequence_cosine
from .sequences import CosineAccumulator, SpectraAccumulator
from .streaming import GeometryAccumulator
from .variance import AnovaAccumulator

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
