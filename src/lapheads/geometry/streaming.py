"""Streaming token geometry for one layer: :class:`GeometryAccumulator`, built from the accumulators of
:mod:`.variance`, :mod:`.classes` and :mod:`.sequences`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .accumulate import F64, Accumulator, check_inputs, dense_ids, or_error
from .classes import ClassAccumulator
from .sequences import CosineAccumulator, SpectraAccumulator, global_spectrum
from .variance import AnovaAccumulator

__all__ = ["GeometryAccumulator"]


class GeometryAccumulator(Accumulator):
    """All measures for one layer: ANOVA, NC on tokens and on sequence means, spectra, cosine.

    Feed it tokens with their sequence ids and ``class_ids`` (the class of each token's sequence,
    an image label: three-way ANOVA, NC on tokens and on sequence means) and/or ``token_classes``
    (a class per token, e.g. the next-token id, -1 for none: linguistic collapse on tokens).

    Args:
        dim: feature dimension.
        min_count: minimum tokens per class for the class-mean measures on tokens.
        threshold: variance fraction for the per-sequence and global k (0.99 = k99).
        spectra: compute per-sequence spectra (after the d x d update, the costliest part).
        cosine: compute the within-sequence cosine.
        tile: block size of the pairwise class computations.
        device: where the sums live.
    """

    _sum_names = ("batches",)

    def __init__(
        self,
        dim: int,
        min_count: int = 1,
        threshold: float = 0.99,
        spectra: bool = True,
        cosine: bool = True,
        tile: int = 2048,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(device)
        self.dim, self.min_count, self.threshold = int(dim), int(min_count), float(threshold)
        self.with_spectra, self.with_cosine = bool(spectra), bool(cosine)
        self.anova = AnovaAccumulator(dim, device=device)
        self.tokens = ClassAccumulator(dim, min_count=min_count, tile=tile, device=device)
        self.seq_means = ClassAccumulator(dim, min_count=1, tile=tile, device=device)
        self.spectra = SpectraAccumulator(dim, threshold, device=device) if spectra else None
        self.cosine = CosineAccumulator(device=device) if cosine else None
        self.batches = torch.zeros((), dtype=torch.int64, device=self.device)

    def _config(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "min_count": self.min_count,
            "threshold": self.threshold,
            "spectra": self.with_spectra,
            "cosine": self.with_cosine,
        }

    def _children(self) -> dict[str, Accumulator]:
        ch = {"anova": self.anova, "tokens": self.tokens, "seq_means": self.seq_means}
        return {k: v for k, v in {**ch, "spectra": self.spectra, "cosine": self.cosine}.items() if v is not None}

    @property
    def n_batches(self) -> int:
        """Batches added (over every merged accumulator and rank)."""
        return int(self.batches)

    @torch.no_grad()
    def update(
        self,
        x: torch.Tensor,
        sequence_ids: torch.Tensor,
        class_ids: Optional[torch.Tensor] = None,
        token_classes: Optional[torch.Tensor] = None,
    ) -> None:
        """Add one batch: ``x`` (N, D) tokens without padding, ``sequence_ids`` (N,) (sequences complete
        in the batch), ``class_ids`` (N,) or None, ``token_classes`` (N,) or None (then ``class_ids``)."""
        x, sid, cid = check_inputs(x, sequence_ids, class_ids, label_name="class_ids", dim=self.dim)
        if token_classes is not None:
            _, _, tcl = check_inputs(x[:, :1], None, token_classes, label_name="token_classes")
        else:
            tcl = cid
        self.anova.check_classes(cid)
        x = x.to(self.device)
        if self.anova.shift is None and self.tokens.shift is None:
            sh = x.mean(0, dtype=F64)
            self.anova.shift, self.tokens.shift = sh, sh.clone()
        # one shifted float64 copy shared by ANOVA and the class sums (the shifts differ only after unusual merges)
        y = x - self.anova.shift
        r = torch.linalg.vector_norm(y, dim=1).square()
        dsid, S = dense_ids(sid.to(self.device))
        ssum = self.anova._update_prepared(y, dsid, S, r, cid)
        same = torch.equal(self.tokens.shift, self.anova.shift)
        if same:
            self.tokens._update_prepared(y, tcl, r, ssum.sum(0))
        else:
            self.tokens.update(x, tcl)
        if cid is not None:
            cnt = torch.bincount(dsid, minlength=S).to(F64)
            means = ssum / cnt[:, None] + self.anova.shift
            scls = torch.zeros(S, dtype=torch.int64, device=x.device).scatter_(0, dsid, cid.to(x.device))
            self.seq_means.update(means, scls)
        if self.spectra is not None:
            self.spectra.update(x, sid)
        if self.cosine is not None:  # from y when the shifts agree, saving a float64 copy of x
            self.cosine._update_prepared(x, dsid, S, y if same else None, self.anova.shift)
        self.batches += 1

    def compute(self, classifier: Optional[tuple[Any, Any]] = None) -> dict[str, Any]:
        """Per-layer result: ``anova``, ``nc_tokens``, ``nc_sequence_means``, ``spectra``, ``cosine``; a
        section the data cannot give (NC with fewer than two classes) holds ``{"error": message}``."""
        res: dict[str, Any] = {"anova": self.anova.compute()}
        for key, acc, clf in (("nc_tokens", self.tokens, classifier), ("nc_sequence_means", self.seq_means, None)):
            if acc._n_classes_capacity():
                res[key] = or_error(lambda acc=acc, clf=clf: acc.compute(clf))
        spec = {"threshold": self.threshold, **global_spectrum(self.tokens.covariance(), self.threshold)}
        if self.spectra is not None:
            spec.update(or_error(self.spectra.compute))
        res["spectra"] = spec
        if self.cosine is not None:
            res["cosine"] = or_error(self.cosine.compute)
        return res
