"""ANOVA of token scatter, streamed: within sequence, between sequences, between classes (the
one-shot :func:`lapheads.geometry.anova` is computed independently, so the two check each other)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import DataError
from .accumulate import F64, Accumulator, check_inputs, dense_ids, segment_sum

__all__ = ["AnovaAccumulator", "add_fractions", "sequence_classes"]


class AnovaAccumulator(Accumulator):
    """Law-of-total-variance decomposition of ``dim``-wide token scatter, streamed (sums on ``device``):
    ``total = within-sequence + between-sequences-within-class + between-class`` (token weighted);
    without classes, within vs between sequences."""

    _sum_names = ("n", "sum", "sumsq", "within", "seqterm", "n_seq", "class_count", "class_sum")
    _extra_names = ("has_classes",)

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.dim = int(dim)
        z = lambda *s: torch.zeros(*s, dtype=F64, device=self.device)  # noqa: E731
        self.n, self.sumsq, self.within, self.seqterm, self.n_seq = z(()), z(()), z(()), z(()), z(())
        self.sum, self.class_count, self.class_sum = z(self.dim), z(0), z(0, self.dim)
        self.has_classes: Optional[bool] = None

    def _config(self) -> dict[str, Any]:
        return {"dim": self.dim}

    def _n_classes_capacity(self) -> int:
        return int(self.class_count.shape[0])

    def _grow(self, n: int) -> None:
        c = self.class_count.shape[0]
        if n > c:
            self.class_count = torch.cat([self.class_count, self.class_count.new_zeros(n - c)])
            self.class_sum = torch.cat([self.class_sum, self.class_sum.new_zeros(n - c, self.dim)])

    def _move_sums(self, d: torch.Tensor) -> None:
        dd = float(d @ d)
        self.sumsq = self.sumsq + 2 * (d @ self.sum) + self.n * dd
        self.seqterm = self.seqterm + 2 * (d @ self.sum) + self.n * dd
        self.sum = self.sum + self.n * d
        self.class_sum = self.class_sum + self.class_count[:, None] * d

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor, class_ids: Optional[torch.Tensor] = None) -> None:
        """Add one batch: ``x`` (N, D) tokens, ``sequence_ids`` (N,) (every sequence complete in this
        batch), ``class_ids`` (N,) the class of each token's sequence, or None."""
        x, sid, cid = check_inputs(x, sequence_ids, class_ids, label_name="class_ids", dim=self.dim)
        self.check_classes(cid, " for ANOVA")
        y = self._prep(x)
        sid, S = dense_ids(sid)
        self._update_prepared(y, sid, S, torch.linalg.vector_norm(y, dim=1).square(), cid)

    def check_classes(self, cid: Optional[torch.Tensor], where: str = "") -> None:
        """Classes must be given for every batch or for none, and be >= 0 (``where`` names the caller)."""
        has = cid is not None
        if self.has_classes is None:
            self.has_classes = has
        elif self.has_classes != has:
            raise DataError("class_ids were given for some batches and not others")
        if has and int(cid.min()) < 0:
            raise DataError(f"class_ids must be >= 0{where} (every sequence needs a class)")

    def _update_prepared(
        self, y: torch.Tensor, sid: torch.Tensor, S: int, r: torch.Tensor, cid: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Add shifted float64 rows (``sid`` dense 0..S-1, ``r`` squared norms); returns per-sequence sums."""
        cnt = torch.bincount(sid, minlength=S).to(F64)
        ssum = segment_sum(y, sid, S)
        sq = (ssum * ssum).sum(1) / cnt
        rs = r.sum()
        self.within += rs - sq.sum()
        self.seqterm += sq.sum()  # sum_s n_s ||mu_s - a||^2
        self.n += y.shape[0]
        self.n_seq += S
        self.sum += ssum.sum(0)
        self.sumsq += rs
        if cid is not None:
            lo = sequence_classes(sid, cid, S)
            self._grow(int(cid.max()) + 1)
            self.class_count.index_add_(0, lo, cnt)
            self.class_sum.index_add_(0, lo, ssum)  # per-sequence sums: S rows, not N
        return ssum

    def compute(self) -> dict[str, float]:
        """Sums and fractions of the decomposition (see :func:`lapheads.geometry.anova`)."""
        if float(self.n) == 0:
            raise DataError("ANOVA: no tokens were accumulated")
        n = float(self.n)
        g = float(self.sum @ self.sum) / n  # N ||mu_G - a||^2
        total = float(self.sumsq) - g
        within = float(self.within)
        out: dict[str, float] = {
            "n_tokens": n,
            "n_sequences": float(self.n_seq),
            "total": total,
            "within_sequence": within,
            "between_sequence": float(self.seqterm) - g,
        }
        if self.has_classes:
            keep = self.class_count > 0
            cterm = float(((self.class_sum[keep] ** 2).sum(1) / self.class_count[keep]).sum())
            out["n_classes"] = float(keep.sum())
            out["between_sequence_within_class"] = float(self.seqterm) - cterm
            out["between_class"] = cterm - g
        add_fractions(out)
        return out


def add_fractions(out: dict[str, float]) -> None:
    """Add ``frac_<part>`` = part / total for each part of the decomposition in ``out``."""
    t = out["total"]
    for k in ("within_sequence", "between_sequence", "between_sequence_within_class", "between_class"):
        if k in out:
            out["frac_" + k] = out[k] / t if t > 0 else float("nan")


def sequence_classes(sid: torch.Tensor, cid: torch.Tensor, S: int) -> torch.Tensor:
    """The class of each of ``S`` sequences (dense ids ``sid``), checking it is constant within each."""
    lo = torch.full((S,), 1 << 62, dtype=torch.int64, device=sid.device).scatter_reduce_(0, sid, cid, "amin")
    hi = torch.full((S,), -1, dtype=torch.int64, device=sid.device).scatter_reduce_(0, sid, cid, "amax")
    if bool((lo != hi).any()):
        raise DataError(
            "class_ids must be constant within each sequence for ANOVA (a sequence has tokens of two classes)"
        )
    return lo
