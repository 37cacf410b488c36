"""Within-sequence structure, streamed: per-sequence covariance spectra (k99) and cosine, each
computed exactly for the sequences of one ``update`` call (each complete in it)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..errors import ConfigError, DataError
from .accumulate import F64, Accumulator, check_inputs, dense_ids, segment_sum

__all__ = ["SpectraAccumulator", "CosineAccumulator", "sequence_eigenvalues", "k_for_threshold", "global_spectrum"]


def _group_sequences(x: torch.Tensor, sid: torch.Tensor) -> list[torch.Tensor]:
    order = torch.argsort(sid, stable=True)
    _, counts = torch.unique_consecutive(sid[order], return_counts=True)
    return list(torch.split(x[order], counts.tolist()))


def sequence_eigenvalues(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Descending covariance eigenvalues of each (T, D) sequence (float64, length min(T, D))."""
    out: list[Optional[torch.Tensor]] = [None] * len(seqs)
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(s.shape[0], []).append(i)
    for T, idx in by_len.items():
        X = torch.stack([seqs[i] for i in idx]).to(F64)
        X = X - X.mean(1, keepdim=True)
        D = X.shape[2]
        G = X @ X.transpose(1, 2) if T <= D else X.transpose(1, 2) @ X
        ev = torch.linalg.eigvalsh(G / T).flip(-1).clamp_min(0.0)
        for k, i in enumerate(idx):
            out[i] = ev[k]
    return out  # type: ignore[return-value]


def k_for_threshold(ev: torch.Tensor, threshold: float) -> int:
    """Smallest k whose top-k eigenvalues explain ``threshold`` of the total (0 if total is 0)."""
    tot = float(ev.sum())
    if tot <= 0:
        return 0
    cum = torch.cumsum(ev, 0) / tot
    return min(int(torch.searchsorted(cum, torch.tensor([threshold], dtype=cum.dtype))[0]) + 1, ev.numel())


def global_spectrum(cov: torch.Tensor, threshold: float) -> dict[str, Any]:
    """``global_k``, ``global_spectrum`` (descending eigenvalues) and ``global_curve`` of a covariance."""
    ev = torch.linalg.eigvalsh(cov).flip(0).clamp_min(0.0)
    tot = float(ev.sum())
    curve = (ev / tot).tolist() if tot > 0 else [0.0] * ev.numel()
    return {"global_k": float(k_for_threshold(ev, threshold)), "global_spectrum": ev.tolist(), "global_curve": curve}


class SpectraAccumulator(Accumulator):
    """Per-sequence covariance spectra of ``dim``-wide tokens: k(``threshold``) (0.99: k99) averaged over
    sequences and the mean decay curve, summed on ``device``. Sequences of one token are skipped; one
    whose tokens are all equal has k = 0 and a zero curve."""

    _sum_names = ("k_count", "curve_sum")  # sequences per k = 0..dim, and the sum of their curves

    def __init__(self, dim: int, threshold: float = 0.99, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        if not 0 < threshold <= 1:
            raise ConfigError(f"threshold must be in (0, 1], got {threshold}")
        self.dim, self.threshold = int(dim), float(threshold)
        z = lambda *s: torch.zeros(*s, dtype=F64, device=self.device)  # noqa: E731
        self.k_count, self.curve_sum = z(self.dim + 1), z(self.dim)

    def _config(self) -> dict[str, Any]:
        return {"dim": self.dim, "threshold": self.threshold}

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor) -> None:
        """Add the sequences of one batch (each complete in this batch)."""
        x, sid, _ = check_inputs(x, sequence_ids, dim=self.dim)
        seqs = [s for s in _group_sequences(x.to(self.device), sid.to(self.device)) if s.shape[0] >= 2]
        for ev in sequence_eigenvalues(seqs):
            k = k_for_threshold(ev, self.threshold)
            tot = float(ev.sum())
            if tot > 0:
                self.curve_sum[: ev.numel()] += ev / tot
            self.k_count[k] += 1

    def compute(self) -> dict[str, Any]:
        """``k_mean`` (e.g. k99 averaged over sequences), std/min/max and the mean curve."""
        n = float(self.k_count.sum())
        if n == 0:
            raise DataError("spectra: no sequence with at least two tokens was seen")
        ks = torch.arange(self.dim + 1, dtype=F64, device=self.device)
        seen = torch.nonzero(self.k_count).flatten()
        m = float(self.k_count @ ks) / n
        return {
            "threshold": self.threshold,
            "n_sequences": n,
            "k_mean": m,
            "k_std": math.sqrt(max(0.0, float(self.k_count @ ks.square()) / n - m * m)),
            "k_min": float(seen[0]),
            "k_max": float(seen[-1]),
            "sequence_curve": (self.curve_sum / n).tolist(),
        }


class CosineAccumulator(Accumulator):
    """Mean pairwise cosine similarity between tokens of one sequence, averaged over sequences: for T
    unit vectors u_i, (||sum u||^2 - sum ||u_i||^2) / (T (T - 1)) (a zero token has cosine 0;
    sequences of one token are skipped), summed on ``device``."""

    _sum_names = ("n_seq", "cos_sum", "cos_sq")  # sums of 1, (c - shift) and (c - shift)^2

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        z = lambda: torch.zeros((), dtype=F64, device=self.device)  # noqa: E731
        self.n_seq, self.cos_sum, self.cos_sq = z(), z(), z()

    def _shift_shape(self) -> Optional[tuple[int, ...]]:
        return ()

    def _move_sums(self, d: torch.Tensor) -> None:
        self.cos_sq = self.cos_sq + 2 * d * self.cos_sum + self.n_seq * d * d
        self.cos_sum = self.cos_sum + self.n_seq * d

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor) -> None:
        """Add the sequences of one batch (each complete in this batch)."""
        x, sid, _ = check_inputs(x, sequence_ids)
        sid, S = dense_ids(sid.to(self.device))
        self._update_prepared(x.to(self.device), sid, S)

    def _update_prepared(
        self,
        x: torch.Tensor,
        sid: torch.Tensor,
        S: int,
        y: Optional[torch.Tensor] = None,
        shift: Optional[torch.Tensor] = None,
    ) -> None:
        """With ``y = x - shift`` given, sum_i x_i/||x_i|| = sum_i y_i/||x_i|| + (sum_i 1/||x_i||) shift
        needs no float64 copy of x."""
        nrm = torch.linalg.vector_norm(x, dim=1, dtype=F64)
        nz = nrm > 0
        inv = torch.where(nz, 1.0 / nrm.clamp_min(1e-300), torch.zeros_like(nrm))
        if y is not None and shift is not None:
            usum = segment_sum(y, sid, S, inv) + torch.bincount(sid, weights=inv, minlength=S)[:, None] * shift
        else:
            usum = segment_sum(x, sid, S, inv)
        usq = torch.bincount(sid, weights=nz.to(F64), minlength=S)
        cnt = torch.bincount(sid, minlength=S).to(F64)
        ok = cnt >= 2
        cos = ((usum * usum).sum(1) - usq)[ok] / (cnt[ok] * (cnt[ok] - 1))
        if not bool(ok.any()):
            return
        if self.shift is None:
            self.shift = cos.mean()
        dev = cos - self.shift
        self.n_seq += int(ok.sum())
        self.cos_sum += dev.sum()
        self.cos_sq += (dev * dev).sum()

    def compute(self) -> dict[str, float]:
        n = float(self.n_seq)
        if n == 0 or self.shift is None:
            raise DataError("cosine: no sequence with at least two tokens was seen")
        dm = float(self.cos_sum) / n  # mean deviation from the shift
        return {
            "cosine_mean": float(self.shift) + dm,
            "cosine_std": math.sqrt(max(0.0, float(self.cos_sq) / n - dm * dm)),
            "n_sequences": n,
        }
