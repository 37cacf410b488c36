"""In-memory geometry measures: one flat ``(N, D)`` tensor of tokens (torch or numpy) with ``(N,)``
integer sequence ids / labels in, a plain dict of floats (float64 arithmetic) out. They give the
numbers of the streaming accumulators (docs/method.md, "The geometry the paper measures")."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .accumulate import F64, check_inputs
from .classes import ClassAccumulator, check_classifier
from .sequences import CosineAccumulator, SpectraAccumulator, global_spectrum
from .streaming import GeometryAccumulator
from .variance import add_fractions, sequence_classes

__all__ = [
    "anova",
    "neural_collapse",
    "cdnv",
    "spectral_k99",
    "spectra",
    "within_sequence_cosine",
    "geometry",
    "pca_rgb",
]


def anova(x: Any, sequence_ids: Any, class_ids: Any = None) -> dict[str, float]:
    """Law-of-total-variance decomposition of token scatter (exactly additive, token-weighted means).

    ``total = sum ||x - mu_G||^2 = within_sequence + between_sequence`` and, with classes,
    ``between_sequence = between_sequence_within_class + between_class``; within_sequence =
    sum ||x(s,t) - mu_s||^2, between_sequence_within_class = sum_s T_s ||mu_s - mu_y(s)||^2,
    between_class = sum_c N_c ||mu_c - mu_G||^2; each also as ``frac_<part>`` = part / total.

    Args:
        x: (N, D) tokens.
        sequence_ids: (N,) sequence id of each token.
        class_ids: (N,) class of each token's sequence (constant within a sequence), or None for a
            within- vs between-sequence split only (a language model).

    Returns:
        The parts, their ``frac_*``, ``n_tokens``, ``n_sequences`` [, ``n_classes``].
    """
    x, sid, cid = check_inputs(x, sequence_ids, class_ids, label_name="class_ids")
    x = x.to(F64)
    _, sid = torch.unique(sid, return_inverse=True)
    S = int(sid.max()) + 1
    ones = torch.ones_like(sid, dtype=F64)
    n_s = torch.zeros(S, dtype=F64).index_add_(0, sid, ones)
    mu_s = torch.zeros(S, x.shape[1], dtype=F64).index_add_(0, sid, x) / n_s[:, None]
    mu_g = x.mean(0)
    out: dict[str, float] = {
        "n_tokens": float(x.shape[0]),
        "n_sequences": float(S),
        "total": float(((x - mu_g) ** 2).sum()),
        "within_sequence": float(((x - mu_s[sid]) ** 2).sum()),
        "between_sequence": float((n_s * ((mu_s - mu_g) ** 2).sum(1)).sum()),
    }
    if cid is not None:
        if int(cid.min()) < 0:
            raise DataError("class_ids must be >= 0 for ANOVA (every sequence needs a class)")
        sequence_classes(sid, cid, S)  # the same check as the streaming accumulator's
        _, cid = torch.unique(cid, return_inverse=True)
        C = int(cid.max()) + 1
        n_c = torch.zeros(C, dtype=F64).index_add_(0, cid, ones)
        mu_c = torch.zeros(C, x.shape[1], dtype=F64).index_add_(0, cid, x) / n_c[:, None]
        out["n_classes"] = float(C)
        out["between_sequence_within_class"] = float(((mu_s[sid] - mu_c[cid]) ** 2).sum())
        out["between_class"] = float((n_c * ((mu_c - mu_g) ** 2).sum(1)).sum())
    add_fractions(out)
    return out


def neural_collapse(
    features: Any, labels: Any, classifier: Optional[tuple[Any, Any]] = None, *, min_count: int = 1, tile: int = 2048
) -> dict[str, float]:
    """Neural Collapse measures (Papyan, Han & Donoho 2020; CDNV of Galanti et al. 2021).

    ``nc1`` = tr(Sigma_W pinv(Sigma_B)) / C (pooled within-class covariance, covariance of the
    centred class means); ``cdnv`` (see :func:`cdnv`); ``nc2_equinorm`` = std / mean of
    ||mu_c - mu_G||; ``nc2_equiangular_std`` / ``_mean`` of the cosines between centred means
    (c != c') and ``nc2_equiangular_shift`` = mean |cos + 1/(C-1)|; ``nc2_etf_distance`` =
    Frobenius distance between the normalised Gram of the row-normalised centred means and that of
    a simplex ETF; with a classifier, ``nc3_self_duality`` = || W/||W|| - M/||M|| ||_F (M the
    centred means, W their rows) and ``nc4_agreement`` = fraction of features whose classifier
    argmax is the nearest class mean (over the kept classes). Means are centred at the
    unweighted mean of the kept class means.

    Args:
        features: (N, D) features.
        labels: (N,) integer class of each row; ``-1`` = no class (ignored).
        classifier: optional ``(weight (K, D), bias (K,) or None)`` or ``nn.Linear``; row c is class c.
        min_count: classes with fewer rows are left out of the class-mean measures.
        tile: block size of the pairwise computations.

    Returns:
        A dict of floats (also ``n_classes``, ``n_tokens``, ``n_pairs``, ``n_pairs_coincident``,
        ``trace_sigma_w``, ``trace_sigma_b``, ``within_class_variance``).
    """
    x, lab, acc = _classes(features, labels, min_count, tile)
    out = acc.compute(classifier)
    if classifier is not None:
        nc4 = acc.nc4_pass(*check_classifier(classifier, acc.dim, acc.kept_classes()))
        nc4.update(x, lab)
        out.update(nc4.compute())
    return out


def cdnv(features: Any, labels: Any, *, min_count: int = 1, tile: int = 2048) -> dict[str, float]:
    """Class-distance normalised variance averaged over class pairs (Galanti et al. 2021).

    ``cdnv`` = mean over c < c' of (var_c + var_c') / (2 ||mu_c - mu_c'||^2), var_c the mean squared
    distance of class c's rows to its mean; pairs whose means coincide are left out and counted in
    ``n_pairs_coincident``. ``labels`` -1 are ignored, classes with fewer than ``min_count`` rows
    left out; ``tile`` is the block size of the pairwise computation. Also returns ``n_classes``,
    ``n_pairs``, ``n_tokens``.
    """
    _, _, acc = _classes(features, labels, min_count, tile)
    return acc.compute(cdnv_only=True)


def _classes(
    features: Any, labels: Any, min_count: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor, ClassAccumulator]:
    """Checked ``(features, labels)`` and a class accumulator fed with them once."""
    x, _, lab = check_inputs(features, None, labels, name="features")
    if lab is None:
        raise DataError("labels are required")
    acc = ClassAccumulator(x.shape[1], min_count=min_count, tile=tile)
    acc.update(x, lab)
    return x, lab, acc


def spectra(x: Any, sequence_ids: Any, threshold: float = 0.99) -> dict[str, Any]:
    """The numbers of :func:`spectral_k99` plus the decay curves ``sequence_curve`` (per-sequence
    eigenvalues normalised to sum 1, averaged over sequences, length D) and ``global_curve``."""
    x, sid, _ = check_inputs(x, sequence_ids)
    acc = SpectraAccumulator(x.shape[1], threshold)
    acc.update(x, sid)
    out = acc.compute()
    xc = x.to(F64) - x.to(F64).mean(0)
    g = global_spectrum(xc.T @ xc / x.shape[0], acc.threshold)
    return {**out, "global_k": g["global_k"], "global_curve": g["global_curve"]}


def spectral_k99(x: Any, sequence_ids: Any, threshold: float = 0.99) -> dict[str, float]:
    """Number of principal components explaining ``threshold`` (0.99: k99) of each sequence's variance.

    For every sequence with >= 2 tokens, k = the smallest count of top covariance eigenvalues that
    reach ``threshold`` of the total (0 for a sequence whose tokens are all equal). Returns
    ``k_mean`` (averaged over sequences), ``k_std``, ``k_min``, ``k_max``, ``n_sequences``,
    ``global_k`` (the same k for the covariance of all tokens) and ``threshold``.
    """
    out = spectra(x, sequence_ids, threshold)
    return {k: v for k, v in out.items() if not isinstance(v, list)}


def within_sequence_cosine(x: Any, sequence_ids: Any) -> dict[str, float]:
    """Mean pairwise cosine similarity between the tokens of a sequence, averaged over sequences:
    ``cosine_mean``, ``cosine_std`` (over sequences) and ``n_sequences``.

    A sequence of T tokens averages over its T (T - 1) ordered pairs i != j; single-token
    sequences are skipped; a zero token has cosine 0 with every other token.
    """
    acc = CosineAccumulator()
    acc.update(x, sequence_ids)
    return acc.compute()


def geometry(
    x: Any,
    sequence_ids: Any,
    class_ids: Any = None,
    token_classes: Any = None,
    *,
    classifier: Optional[tuple[Any, Any]] = None,
    min_count: int = 1,
    threshold: float = 0.99,
) -> dict[str, Any]:
    """Every measure of one layer at once (the dict :class:`GeometryAccumulator` computes)."""
    x, sid, _ = check_inputs(x, sequence_ids)
    acc = GeometryAccumulator(x.shape[1], min_count=min_count, threshold=threshold)
    acc.update(x, sid, class_ids, token_classes)
    return acc.compute(classifier)


def pca_rgb(tokens: Any, grid_hw: tuple[int, int]) -> np.ndarray:
    """Top three principal components of patch tokens ``(N, P, D)`` (no CLS tokens, P = H * W for
    ``grid_hw`` = (H, W)) as RGB, ``(N, H, W, 3)`` in [0, 1]: fitted jointly on all images, each
    component min-max scaled over all images, its sign fixed so its largest loading is positive."""
    t = torch.as_tensor(tokens)
    if t.dim() != 3:
        raise DataError(f"tokens must be (images, patches, dim), got shape {tuple(t.shape)}")
    H, W = int(grid_hw[0]), int(grid_hw[1])
    N, P, D = t.shape
    if H * W != P:
        raise ConfigError(f"grid {H}x{W} = {H * W} patches but tokens have {P}")
    if not bool(torch.isfinite(t).all()):
        raise DataError("tokens contain NaN or Inf")
    X = t.reshape(N * P, D).to(F64)
    X = X - X.mean(0)
    k = min(3, D, N * P)
    _, _, Vh = torch.linalg.svd(X, full_matrices=False)
    V = Vh[:k].T
    big = V.abs().argmax(0)
    sgn = torch.sign(V[big, torch.arange(k)])
    sgn[sgn == 0] = 1.0
    V = V * sgn
    Z = X @ V
    lo, hi = Z.min(0).values, Z.max(0).values
    Z = (Z - lo) / (hi - lo).where(hi > lo, torch.ones_like(hi))
    if k < 3:
        Z = torch.cat([Z, Z.new_zeros(Z.shape[0], 3 - k)], 1)
    return Z.reshape(N, H, W, 3).numpy()
