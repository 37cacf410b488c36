"""Streaming accumulators for token geometry (ANOVA, Neural Collapse, spectra, cosine).

Each accumulator is fed batch by batch with ``update(x, ...)`` where ``x`` is a flat ``(N, D)``
tensor of token representations and ``sequence_ids`` a ``(N,)`` integer tensor, and answers
with ``compute() -> dict``. The in-memory functions of :mod:`lapheads.geometry.measures` give the
same numbers on one tensor.

Design choices:

- **float64 sums.** Every sum is kept in float64 whatever the input dtype, so bf16 / fp32
  activations of millions of tokens lose nothing to accumulation order.
- **A shift against cancellation.** Raw second moments (``sum x x^T - N mu mu^T``) cancel badly
  when the mean is large compared with the spread (LLM hidden states have "massive activation"
  dimensions). Each accumulator subtracts a reference vector ``shift`` (the mean of its first
  batch) before summing; all variances are shift-invariant. Merging accumulators with different
  shifts re-expresses one in the other's shift exactly (``_reshift``); ``all_reduce`` broadcasts
  rank 0's shift first.
- **Memory O(d^2 + classes x d).** Per-class sums use ``index_add_`` on a ``(C, D)`` table and
  never a one-hot matrix. The table grows on demand, so the number of classes need not be known
  in advance (a 50,257-token vocabulary is 50,257 x D x 8 bytes = 309 MB at D = 768).
- **Sequences are complete within one ``update`` call.** Sequence ids only need to be unique
  within a call; the within-sequence parts (ANOVA, per-sequence spectra, cosine) are computed
  exactly, centred, for the sequences of each call and then only their sums are kept.
- **Pairwise measures are tiled.** CDNV and the cosine statistics over class pairs are computed in
  ``tile x tile`` blocks of the class-mean table, so 50k classes (1.25e9 pairs) fit in memory.
- **Mergeable and resumable.** ``merge(other)`` adds another accumulator's sums;
  ``all_reduce()`` sums across processes when ``torch.distributed`` is initialised (a no-op
  otherwise); ``state_dict()`` / ``load_state_dict()`` save and resume mid-stream exactly.
- **NC4 needs the features twice.** The nearest-class-centre rule needs the final class means,
  so in streaming mode NC4 is a second pass: ``ClassAccumulator.nc4_pass(weight, bias)`` returns
  an :class:`NC4Accumulator` holding the finished means, fed with the same batches again.

Definitions (see PAPER.md "The geometry analyses"); for classes ``c`` with token count ``N_c``:

- ``Sigma_W`` is the pooled within-class covariance over all labelled tokens,
  ``sum_i (x_i - mu_{y_i})(x_i - mu_{y_i})^T / N`` (Papyan et al.'s definition for balanced
  classes). With ``min_count > 1`` the rare classes are dropped from every class-mean measure but
  their (small) within-class scatter stays in ``Sigma_W``: removing it exactly would need a
  ``d x d`` matrix per class.
- Class-mean measures (``Sigma_B``, NC2, NC3, CDNV) centre the means at the unweighted mean of
  the kept class means, so the centred means sum to zero as a simplex ETF's do; for balanced
  classes this is the token-weighted global mean of the paper's notation. ANOVA uses the
  token-weighted global mean, as the law of total variance requires.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..errors import ConfigError, DataError

F64 = torch.float64

__all__ = [
    "Accumulator",
    "AnovaAccumulator",
    "ClassAccumulator",
    "NC4Accumulator",
    "SpectraAccumulator",
    "CosineAccumulator",
    "GeometryAccumulator",
    "check_inputs",
]


# ---------------------------------------------------------------------------------------------
# input validation


def check_inputs(x: torch.Tensor, sequence_ids: Optional[torch.Tensor] = None,
                 labels: Optional[torch.Tensor] = None, *, name: str = "x",
                 label_name: str = "labels") -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                      Optional[torch.Tensor]]:
    """Validate and convert one batch: ``x`` (N, D) finite, ids/labels (N,) integer.

    Args:
        x: token representations, (N, D); numpy arrays are accepted.
        sequence_ids: sequence id of each token, (N,).
        labels: class of each token, (N,); ``-1`` means "no class" (e.g. the last token of a
            sequence for next-token classes).
        name: how to call ``x`` in error messages.
        label_name: how to call ``labels`` in error messages.

    Returns:
        ``(x, sequence_ids, labels)`` as torch tensors (ids and labels as int64).
    """
    x = torch.as_tensor(x)
    if x.dim() != 2:
        raise DataError(f"{name} must be a 2-D (tokens, dim) array, got shape {tuple(x.shape)}")
    if not (x.is_floating_point()):
        raise DataError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.shape[0] == 0:
        raise DataError(f"{name} is empty (0 tokens)")
    # one reduction instead of an elementwise isfinite (a pass that costs as much as a tenth of
    # the d x d update): a NaN/Inf makes the float64 sum non-finite; only then look closer
    if not bool(torch.isfinite(x.sum(dtype=torch.float64))) and not bool(torch.isfinite(x).all()):
        bad = torch.nonzero(~torch.isfinite(x))[0]
        raise DataError(f"{name} contains NaN or Inf (first at token {int(bad[0])}, dim {int(bad[1])}); "
                        "geometry needs finite features")

    def _ids(t: Any, what: str) -> torch.Tensor:
        t = torch.as_tensor(t)
        if t.dim() != 1 or t.shape[0] != x.shape[0]:
            raise DataError(f"{what} must have shape ({x.shape[0]},) to match {name} "
                            f"{tuple(x.shape)}, got {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise DataError(f"{what} must be integers, got dtype {t.dtype}")
        return t.to(device=x.device, dtype=torch.int64)

    sid = _ids(sequence_ids, "sequence_ids") if sequence_ids is not None else None
    lab = _ids(labels, label_name) if labels is not None else None
    if lab is not None and lab.numel() and int(lab.min()) < -1:
        raise DataError(f"{label_name} must be >= 0 (or -1 for 'no class'), got {int(lab.min())}")
    if sid is not None and int(sid.min()) < 0:
        raise DataError(f"sequence_ids must be >= 0, got {int(sid.min())}")
    return x, sid, lab


def _segment_sum(src: torch.Tensor, sid: torch.Tensor, S: int, weights: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """Per-segment float64 sums of the rows of ``src`` (optionally weighted), (S, D).

    For few segments (sequences of one batch) a dense (S, N) x (N, D) product reads ``src`` once
    and runs as a GEMM; for many segments ``index_add_`` avoids the S x N matrix.
    """
    if S <= 64:
        A = torch.zeros(S, src.shape[0], dtype=F64, device=src.device)
        A[sid, torch.arange(src.shape[0], device=src.device)] = 1.0 if weights is None else weights
        return A @ src.to(F64) if src.dtype != F64 else A @ src
    s = src.to(F64) if weights is None else src * weights[:, None].to(F64)
    return torch.zeros(S, src.shape[1], dtype=F64, device=src.device).index_add_(0, sid, s)


def _dense_ids(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary non-negative ids to 0..S-1 (in sorted order); returns (dense ids, S)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    return inv, int(uniq.numel())


# ---------------------------------------------------------------------------------------------
# base class


class Accumulator:
    """Base class: a bag of float64 state tensors that are summed to merge.

    Subclasses list their summable tensors in ``_sum_names`` and their configuration (checked
    on merge / load) in ``_config()``; ``_reshift`` re-expresses shifted sums in a new shift.
    """

    _sum_names: tuple[str, ...] = ()

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    # -- configuration ------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {}

    def _children(self) -> dict[str, "Accumulator"]:
        return {}

    def _check_compatible(self, other: "Accumulator") -> None:
        if type(other) is not type(self):
            raise ConfigError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if other._config() != self._config():
            raise ConfigError(f"cannot merge accumulators with different settings: "
                              f"{self._config()} vs {other._config()}")

    # -- shifting (overridden by shifted accumulators) ----------------------------------------
    shift: Optional[torch.Tensor] = None

    def _reshift(self, new_shift: torch.Tensor) -> None:  # pragma: no cover - trivial default
        self.shift = new_shift

    def _grow(self, n: int) -> None:
        """Make room for ``n`` classes (class-table accumulators override this)."""

    def _n_classes_capacity(self) -> int:
        return 0

    # -- merge / distributed ------------------------------------------------------------------
    def merge(self, other: "Accumulator") -> "Accumulator":
        """Add the sums of ``other`` (same type and settings) into ``self``; returns ``self``."""
        self._check_compatible(other)
        if self.shift is None and other.shift is not None:
            self._reshift(other.shift.clone())
        if other.shift is not None and not torch.equal(self.shift, other.shift):
            other = other.copy()
            other._reshift(self.shift)
        cap = max(self._n_classes_capacity(), other._n_classes_capacity())
        self._grow(cap)
        if other._n_classes_capacity() < cap:
            other = other.copy() if other is not self else other
            other._grow(cap)
        for n in self._sum_names:
            a, b = getattr(self, n), getattr(other, n)
            setattr(self, n, a + b.to(a.device))
        self._merge_extra(other)
        for k, ch in self._children().items():
            ch.merge(other._children()[k])
        return self

    def _merge_extra(self, other: "Accumulator") -> None:
        """Hook for state that is not a plain sum (min/max)."""

    def copy(self) -> "Accumulator":
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        for n in self._sum_names:
            setattr(new, n, getattr(self, n).clone())
        if self.shift is not None:
            new.shift = self.shift.clone()
        for k, ch in self._children().items():
            setattr(new, k, ch.copy())
        return new

    def all_reduce(self, group: Any = None) -> "Accumulator":
        """Sum the state over all processes of ``torch.distributed`` (no-op when not initialised).

        Every rank must call it. Rank 0's shift is broadcast first and the other ranks re-express
        their sums in it, so the summed state is exactly the state of one accumulator fed with
        every rank's batches.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        cap = torch.tensor([self._n_classes_capacity()], dtype=torch.int64, device=self.device)
        dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=group)
        self._grow(int(cap.item()))
        if hasattr(self, "dim"):
            # rank 0 might have seen no data: take the shift of the lowest rank that has one
            ranks = torch.tensor([dist.get_rank() if self.shift is not None else 1 << 30],
                                 device=self.device)
            dist.all_reduce(ranks, op=dist.ReduceOp.MIN, group=group)
            src = int(ranks.item())
            if src < (1 << 30):
                sh = self.shift if self.shift is not None else torch.zeros(self.dim, dtype=F64,
                                                                           device=self.device)
                sh = sh.clone()
                dist.broadcast(sh, src=src, group=group)
                if self.shift is None:
                    self.shift = sh
                elif not torch.equal(sh, self.shift):
                    self._reshift(sh)
        for n in self._sum_names:
            t = getattr(self, n)
            dist.all_reduce(t, group=group)
        self._all_reduce_extra(group)
        for ch in self._children().values():
            ch.all_reduce(group)
        return self

    def _all_reduce_extra(self, group: Any) -> None:
        """Hook for state that is not a plain sum."""

    # -- save / restore -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: config, sums, shift and children (tensors on CPU)."""
        sd: dict[str, Any] = {"type": type(self).__name__, "config": self._config(),
                              "shift": None if self.shift is None else self.shift.cpu().clone()}
        for n in self._sum_names:
            sd[n] = getattr(self, n).detach().cpu().clone()
        sd.update(self._extra_state())
        sd["children"] = {k: ch.state_dict() for k, ch in self._children().items()}
        return sd

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> "Accumulator":
        """Restore from :meth:`state_dict`; the settings must match the saved ones."""
        if sd.get("type") != type(self).__name__:
            raise ConfigError(f"state is for {sd.get('type')!r}, not {type(self).__name__}")
        if sd.get("config") != self._config():
            raise ConfigError(f"saved accumulator settings {sd.get('config')} differ from "
                              f"these {self._config()}")
        self.shift = None if sd["shift"] is None else sd["shift"].to(self.device, F64)
        for n in self._sum_names:
            setattr(self, n, sd[n].to(self.device).clone())
        self._load_extra(sd)
        for k, ch in self._children().items():
            ch.load_state_dict(sd["children"][k])
        return self

    def _load_extra(self, sd: dict[str, Any]) -> None:
        pass

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        """float64 copy of ``x`` minus the shift (set from the first batch's mean)."""
        x = x.to(self.device)
        if self.shift is None:
            self.shift = x.mean(0, dtype=F64)
        return x - self.shift  # promotes to float64 in the same pass


# ---------------------------------------------------------------------------------------------
# ANOVA


class AnovaAccumulator(Accumulator):
    """Law-of-total-variance decomposition of token scatter, streamed.

    ``total = within-sequence + between-sequences-within-class + between-class`` (sums of squared
    distances, token weighted). Without classes the decomposition is within vs between
    sequences.

    Args:
        dim: feature dimension D.
        device: where the sums live.
    """

    _sum_names = ("n", "sum", "sumsq", "within", "seqterm", "n_seq", "class_count", "class_sum")

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.dim = int(dim)
        z = lambda *s: torch.zeros(*s, dtype=F64, device=self.device)  # noqa: E731
        self.n, self.sumsq, self.within, self.seqterm, self.n_seq = z(()), z(()), z(()), z(()), z(())
        self.sum = z(self.dim)
        self.class_count = z(0)
        self.class_sum = z(0, self.dim)
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

    def _reshift(self, new_shift: torch.Tensor) -> None:
        if self.shift is None:
            self.shift = new_shift.to(self.device, F64)
            return
        d = self.shift - new_shift.to(self.device, F64)  # x - b = (x - a) + d
        dd = float(d @ d)
        self.sumsq = self.sumsq + 2 * (d @ self.sum) + self.n * dd
        self.seqterm = self.seqterm + 2 * (d @ self.sum) + self.n * dd
        self.sum = self.sum + self.n * d
        self.class_sum = self.class_sum + self.class_count[:, None] * d
        self.shift = new_shift.to(self.device, F64).clone()

    def _extra_state(self) -> dict[str, Any]:
        return {"has_classes": self.has_classes}

    def _load_extra(self, sd: dict[str, Any]) -> None:
        self.has_classes = sd.get("has_classes")

    def _merge_extra(self, other: "Accumulator") -> None:
        assert isinstance(other, AnovaAccumulator)
        if self.has_classes is None:
            self.has_classes = other.has_classes

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor,
               class_ids: Optional[torch.Tensor] = None) -> None:
        """Add one batch.

        Args:
            x: (N, D) tokens.
            sequence_ids: (N,) sequence of each token; every sequence is complete in this batch.
            class_ids: (N,) class of each token's sequence (constant within a sequence), or None.
        """
        x, sid, cid = check_inputs(x, sequence_ids, class_ids, label_name="class_ids")
        if x.shape[1] != self.dim:
            raise DataError(f"x has dimension {x.shape[1]}, this accumulator expects {self.dim}")
        has = cid is not None
        if self.has_classes is None:
            self.has_classes = has
        elif self.has_classes != has:
            raise DataError("class_ids were given for some batches and not others")
        if has and int(cid.min()) < 0:
            raise DataError("class_ids must be >= 0 for ANOVA (every sequence needs a class)")
        y = self._prep(x)
        sid, S = _dense_ids(sid)
        self._update_prepared(y, sid, S, torch.linalg.vector_norm(y, dim=1).square(), cid)

    def _update_prepared(self, y: torch.Tensor, sid: torch.Tensor, S: int, r: torch.Tensor,
                         cid: Optional[torch.Tensor]) -> torch.Tensor:
        """Add shifted float64 rows; ``sid`` dense 0..S-1, ``r`` squared row norms.

        The within-sequence scatter is sum ||y||^2 - sum_s ||S_s||^2 / n_s per batch: exact up to
        float64 rounding because ``y`` is already shifted near the data, and it needs one pass
        over the rows instead of four for the centred form. Returns the per-sequence sums.
        """
        cnt = torch.bincount(sid, minlength=S).to(F64)
        ssum = _segment_sum(y, sid, S)
        sq = (ssum * ssum).sum(1) / cnt
        rs = r.sum()
        self.within += rs - sq.sum()
        self.seqterm += sq.sum()                     # sum_s n_s ||mu_s - a||^2
        self.n += y.shape[0]
        self.n_seq += S
        self.sum += ssum.sum(0)
        self.sumsq += rs
        if cid is not None:
            lo = torch.full((S,), 1 << 62, dtype=torch.int64, device=y.device).scatter_reduce_(
                0, sid, cid, "amin")
            hi = torch.full((S,), -1, dtype=torch.int64, device=y.device).scatter_reduce_(
                0, sid, cid, "amax")
            if bool((lo != hi).any()):
                raise DataError("class_ids must be constant within each sequence for ANOVA "
                                "(a sequence has tokens of two classes)")
            self._grow(int(cid.max()) + 1)
            self.class_count.index_add_(0, lo, cnt)
            self.class_sum.index_add_(0, lo, ssum)   # per-sequence sums: S rows, not N
        return ssum

    def compute(self) -> dict[str, float]:
        """Sums and fractions of the decomposition (see :func:`lapheads.geometry.anova`)."""
        if float(self.n) == 0:
            raise DataError("ANOVA: no tokens were accumulated")
        n = float(self.n)
        g = float(self.sum @ self.sum) / n          # N ||mu_G - a||^2
        total = float(self.sumsq) - g
        within = float(self.within)
        out: dict[str, float] = {"n_tokens": n, "n_sequences": float(self.n_seq), "total": total,
                                 "within_sequence": within}
        between_seq = float(self.seqterm) - g
        out["between_sequence"] = between_seq
        if self.has_classes:
            keep = self.class_count > 0
            cterm = float(((self.class_sum[keep] ** 2).sum(1) / self.class_count[keep]).sum())
            out["n_classes"] = float(keep.sum())
            out["between_sequence_within_class"] = float(self.seqterm) - cterm
            out["between_class"] = cterm - g
        _fractions(out)
        return out


def _fractions(out: dict[str, float]) -> None:
    t = out["total"]
    for k in ("within_sequence", "between_sequence", "between_sequence_within_class", "between_class"):
        if k in out:
            out["frac_" + k] = out[k] / t if t > 0 else float("nan")


# ---------------------------------------------------------------------------------------------
# class statistics: Neural Collapse, CDNV, linguistic collapse


class ClassAccumulator(Accumulator):
    """Per-class first moments plus the second moment of all tokens, for Neural Collapse.

    Keeps, in float64: per class the count, the sum and the sum of squared norms (``index_add_``
    into a table that grows with the largest label), and ``sum x x^T`` over the labelled tokens
    and, separately, over unlabelled tokens (label ``-1``) so the global covariance covers every
    token while ``Sigma_W`` covers the labelled ones.

    Args:
        dim: feature dimension D.
        num_classes: initial size of the class table (grows when a larger label arrives).
        min_count: classes with fewer tokens are left out of the class-mean measures
            (linguistic collapse uses e.g. 10 so rare next tokens do not dominate).
        tile: block size of the pairwise (class x class) computations.
        device: where the sums live.
    """

    _sum_names = ("count", "csum", "csq", "n_lab", "s_lab", "q_lab", "n_unl", "s_unl", "q_unl")

    def __init__(self, dim: int, num_classes: int = 0, min_count: int = 1, tile: int = 2048,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        if min_count < 1:
            raise ConfigError(f"min_count must be >= 1, got {min_count}")
        if tile < 1:
            raise ConfigError(f"tile must be >= 1, got {tile}")
        self.dim, self.min_count, self.tile = int(dim), int(min_count), int(tile)
        z = lambda *s: torch.zeros(*s, dtype=F64, device=self.device)  # noqa: E731
        self.count, self.csum, self.csq = z(0), z(0, self.dim), z(0)
        self.n_lab, self.s_lab, self.q_lab = z(()), z(self.dim), z(self.dim, self.dim)
        self.n_unl, self.s_unl, self.q_unl = z(()), z(self.dim), z(self.dim, self.dim)
        self._grow(int(num_classes))

    def _config(self) -> dict[str, Any]:
        return {"dim": self.dim, "min_count": self.min_count}

    def _n_classes_capacity(self) -> int:
        return int(self.count.shape[0])

    def _grow(self, n: int) -> None:
        c = self.count.shape[0]
        if n > c:
            # grow by >= 25% so a stream of rising labels costs few copies; pass num_classes
            # up front (e.g. the vocabulary size) to avoid any slack
            n = max(n, c + c // 4) if c else n
            self.count = torch.cat([self.count, self.count.new_zeros(n - c)])
            self.csq = torch.cat([self.csq, self.csq.new_zeros(n - c)])
            self.csum = torch.cat([self.csum, self.csum.new_zeros(n - c, self.dim)])

    def _reshift(self, new_shift: torch.Tensor) -> None:
        new_shift = new_shift.to(self.device, F64)
        if self.shift is None:
            self.shift = new_shift.clone()
            return
        d = self.shift - new_shift
        dd = float(d @ d)
        self.csq = self.csq + 2 * (self.csum @ d) + self.count * dd
        self.csum = self.csum + self.count[:, None] * d
        for n, s, q in (("n_lab", "s_lab", "q_lab"), ("n_unl", "s_unl", "q_unl")):
            N, S, Q = getattr(self, n), getattr(self, s), getattr(self, q)
            Q = Q + torch.outer(S, d) + torch.outer(d, S) + N * torch.outer(d, d)
            setattr(self, q, Q)
            setattr(self, s, S + N * d)
        self.shift = new_shift.clone()

    @torch.no_grad()
    def update(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> None:
        """Add one batch.

        Args:
            x: (N, D) features.
            labels: (N,) class of each row, ``-1`` for "no class" (counted in the global
                covariance only). ``None`` means every row is unlabelled.
        """
        x, _, lab = check_inputs(x, None, labels)
        if x.shape[1] != self.dim:
            raise DataError(f"x has dimension {x.shape[1]}, this accumulator expects {self.dim}")
        y = self._prep(x)
        if lab is None:
            lab = torch.full((y.shape[0],), -1, dtype=torch.int64, device=y.device)
        self._update_prepared(y, lab.to(y.device), torch.linalg.vector_norm(y, dim=1).square(), y.sum(0))

    def _update_prepared(self, y: torch.Tensor, lab: torch.Tensor, r: torch.Tensor, ysum: torch.Tensor) -> None:
        """Add shifted float64 rows ``y`` with labels, squared norms ``r`` and column sum ``ysum``.

        Written for speed (each pass over an N x D float64 array costs about as much as a tenth
        of the d x d update): one GEMM over all rows, one ``index_add_`` for the class sums;
        the few unlabelled rows (one per sequence for next-token classes) are routed to class 0
        and their contribution is subtracted again, which avoids copying the labelled rows out.
        """
        unl = lab < 0
        n_u = int(unl.sum())
        self.q_lab.addmm_(y.T, y)
        self.s_lab += ysum
        self.n_lab += y.shape[0] - n_u
        if n_u == y.shape[0]:  # nothing labelled: move everything to the unlabelled moments
            self.q_lab.addmm_(y.T, y, alpha=-1.0)
            self.s_lab -= ysum
            self.n_unl += n_u
            self.s_unl += ysum
            self.q_unl.addmm_(y.T, y)
            return
        self._grow(int(lab.max()) + 1)
        if n_u:
            yu = y[unl]
            su = yu.sum(0)
            self.q_lab.addmm_(yu.T, yu, alpha=-1.0)
            self.s_lab -= su
            self.n_unl += n_u
            self.s_unl += su
            self.q_unl.addmm_(yu.T, yu)
            lab = lab.clamp_min(0)
        self.count.index_add_(0, lab, torch.ones_like(lab, dtype=F64))
        self.csum.index_add_(0, lab, y)
        self.csq.index_add_(0, lab, r)
        if n_u:
            self.count[0] -= n_u
            self.csum[0] -= su
            self.csq[0] -= r[unl].sum()
            if float(self.count[0]) == 0:  # clear rounding residue of an empty class 0
                self.csum[0].zero_()
                self.csq[0].zero_()

    # -- finalisation -------------------------------------------------------------------------
    def covariance(self, labelled_only: bool = False) -> torch.Tensor:
        """Global (population) covariance of the tokens seen, float64 (D, D)."""
        n = float(self.n_lab) + (0.0 if labelled_only else float(self.n_unl))
        if n == 0:
            raise DataError("no tokens were accumulated")
        s = self.s_lab if labelled_only else self.s_lab + self.s_unl
        q = self.q_lab if labelled_only else self.q_lab + self.q_unl
        mu = s / n
        return q / n - torch.outer(mu, mu)

    def kept_classes(self) -> torch.Tensor:
        """Indices of classes with at least ``min_count`` tokens."""
        return torch.nonzero(self.count >= self.min_count).flatten()

    def class_means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept class indices, their means in the original coordinates)."""
        keep = self.kept_classes()
        mu = self.csum[keep] / self.count[keep, None]
        return keep, mu + (self.shift if self.shift is not None else 0.0)

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        keep = self.kept_classes()
        if keep.numel() < 2:
            raise DataError(f"Neural Collapse needs at least two classes with >= {self.min_count} "
                            f"token(s); got {int(keep.numel())} (labels seen: "
                            f"{int((self.count > 0).sum())})")
        cnt = self.count[keep]
        mu = self.csum[keep] / cnt[:, None]
        # within-class average squared distance to the class mean (Galanti's variance)
        var = (self.csq[keep] / cnt - (mu * mu).sum(1)).clamp_min(0.0)
        return keep, cnt, mu, var

    def compute(self, classifier: Optional[tuple[Any, Any]] = None, *,
                cdnv_only: bool = False) -> dict[str, float]:
        """The Neural Collapse measures (see :func:`lapheads.geometry.neural_collapse`).

        Args:
            classifier: optional ``(weight (K, D), bias (K,) or None)``; row ``c`` of the weight
                is class ``c``'s classifier. Gives NC3 (NC4 needs :meth:`nc4_pass`).
            cdnv_only: compute only the CDNV (skips the d x d eigen-decomposition).
        """
        keep, cnt, mu, var = self._kept()
        C = int(keep.numel())
        M = mu.sub_(mu.mean(0))                        # centred class means (C, D), in place
        pair = _pairwise(M, var, self.tile)
        out: dict[str, float] = {"n_classes": float(C), "n_tokens": float(cnt.sum()),
                                 "cdnv": pair["cdnv"], "n_pairs": pair["n_pairs"],
                                 "n_pairs_coincident": pair["n_pairs_coincident"]}
        if cdnv_only:
            return out
        # pooled within-class scatter over every labelled class (see module docstring)
        allc = torch.nonzero(self.count > 0).flatten()
        # q_lab - sum_c S_c S_c^T / N_c, in row blocks so no second C x D table is built
        scat = self.q_lab.clone()
        for i in range(0, allc.numel(), self.tile):
            idx = allc[i:i + self.tile]
            blk = self.csum[idx] / self.count[idx].sqrt()[:, None]
            scat.addmm_(blk.T, blk, alpha=-1.0)
        sigma_w = scat / self.n_lab
        sigma_b = M.T @ M / C
        evals, evecs = torch.linalg.eigh(sigma_b)
        tol = float(evals.max()) * max(self.dim, C) * torch.finfo(F64).eps
        ok = evals > tol
        V = evecs[:, ok]
        nc1 = float(((V.T @ sigma_w @ V).diagonal() / evals[ok]).sum()) / C
        norms = M.norm(dim=1)
        out.update({
            "nc1": nc1,
            "trace_sigma_w": float(sigma_w.trace()),
            "trace_sigma_b": float(sigma_b.trace()),
            "within_class_variance": float((var * cnt).sum() / cnt.sum()),
            "nc2_equinorm": float(norms.std(unbiased=False) / norms.mean()) if float(norms.mean()) > 0 else float("nan"),
            "nc2_equiangular_std": pair["cos_std"],
            "nc2_equiangular_mean": pair["cos_mean"],
            "nc2_equiangular_shift": pair["cos_shift"],
            "nc2_etf_distance": pair["etf_distance"],
        })
        if classifier is not None:
            W, _ = _check_classifier(classifier, self.dim, keep)
            Wk = W[keep]
            out["nc3_self_duality"] = float((Wk / Wk.norm() - M / M.norm()).norm())
        return out

    def nc4_pass(self, weight: Any, bias: Any = None) -> "NC4Accumulator":
        """Start the second pass for NC4 with the final class means of this accumulator."""
        keep, means = self.class_means()
        if keep.numel() < 2:
            raise DataError("NC4 needs at least two classes")
        return NC4Accumulator(means, keep, weight, bias, tile=self.tile, device=self.device)


def _check_classifier(classifier: Any, dim: int, keep: torch.Tensor
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(classifier, torch.nn.Linear):
        classifier = (classifier.weight, classifier.bias)
    if not isinstance(classifier, (tuple, list)) or len(classifier) != 2:
        raise ConfigError("classifier must be (weight, bias) or an nn.Linear")
    W = torch.as_tensor(classifier[0]).detach().to("cpu", F64)
    b = classifier[1]
    b = None if b is None else torch.as_tensor(b).detach().to("cpu", F64)
    if W.dim() != 2 or W.shape[1] != dim:
        raise ConfigError(f"classifier weight must have shape (classes, {dim}), got {tuple(W.shape)}")
    if keep.numel() and int(keep.max()) >= W.shape[0]:
        raise ConfigError(f"classifier has {W.shape[0]} rows but class {int(keep.max())} occurs")
    if b is not None and b.shape != (W.shape[0],):
        raise ConfigError(f"classifier bias must have shape ({W.shape[0]},), got {tuple(b.shape)}")
    return W, b


def _pairwise(M: torch.Tensor, var: torch.Tensor, tile: int) -> dict[str, float]:
    """Tiled statistics over class pairs c < c' of centred means M (C, D) and variances var (C,).

    CDNV_cc' = (var_c + var_c') / (2 ||mu_c - mu_c'||^2), averaged over the pairs whose means
    differ. Pairs with coincident means (``||mu_c - mu_c'||^2`` within rounding of 0, i.e. at most
    1e-9 (||mu_c||^2 + ||mu_c'||^2)) have no finite CDNV (0/0 when both variances are 0 too);
    they are left out and counted as ``n_pairs_coincident``. They occur where a token's features
    depend only on its input id (the embedding layer): two next-token classes that always follow
    the same token have the same mean. Cosines between centred means give the
    equiangularity numbers; the sum of squared cosines gives ||G||_F of the normalised Gram, and
    with the closed form of the ETF Gram E = C/(C-1) (I - 11^T/C) the ETF distance
    || G/||G|| - E/||E|| ||_F = sqrt(2 - 2 <G, E> / (||G|| ||E||)). One GEMM per tile; the
    elementwise work is done in place to keep memory at a few tile-sized buffers.
    """
    C = M.shape[0]
    sq = (M * M).sum(1)
    nrm = sq.sqrt()
    inv_n = torch.where(nrm > 0, 1.0 / nrm.clamp_min(1e-300), torch.zeros_like(nrm))
    s_cdnv = s_cos = s_cos2 = s_shift = 0.0
    n_coincident = 0
    inv = 1.0 / (C - 1)
    for i in range(0, C, tile):
        Mi = M[i:i + tile]
        for j in range(i, C, tile):
            dots = Mi @ M[j:j + tile].T
            d2 = sq[i:i + tile, None] + sq[None, j:j + tile]
            d2.sub_(dots, alpha=2.0).clamp_(min=0.0)
            cos = dots.mul_(inv_n[i:i + tile, None]).mul_(inv_n[None, j:j + tile])
            vv = var[i:i + tile, None] + var[None, j:j + tile]
            # sq_i + sq_j - 2 dot is exact to ~eps (sq_i + sq_j); below 1e-9 of that the means coincide
            apart = d2 > 1e-9 * (sq[i:i + tile, None] + sq[None, j:j + tile])
            if i == j:  # only c < c' inside a diagonal block
                mask = torch.ones_like(d2, dtype=torch.bool).triu_(1)
                d2, cos, vv, apart = d2[mask], cos[mask], vv[mask], apart[mask]
            n_coincident += int(apart.numel()) - int(apart.sum())
            s_cdnv += float(vv.div_(d2.mul_(2.0))[apart].sum())
            s_cos += float(cos.sum())
            s_cos2 += float(torch.dot(cos.flatten(), cos.flatten()))
            s_shift += float(cos.add_(inv).abs_().sum())
    P = C * (C - 1) / 2
    cmean = s_cos / P
    unit = (nrm > 0).to(M.dtype)                   # ||u_c||^2: 1, or 0 for a zero mean
    g2 = float(unit.sum()) + 2 * s_cos2            # ||G||_F^2
    tot = inv_n @ M                                # sum of the unit rows
    ge = C / (C - 1) * (float(unit.sum()) - float(tot @ tot) / C)   # <G, E>
    e_norm = C / math.sqrt(C - 1)
    etf = math.sqrt(max(0.0, 2.0 - 2.0 * ge / (math.sqrt(g2) * e_norm)))
    n_apart = P - n_coincident
    return {"cdnv": s_cdnv / n_apart if n_apart else float("nan"), "n_pairs": P,
            "n_pairs_coincident": float(n_coincident), "cos_mean": cmean,
            "cos_std": math.sqrt(max(0.0, s_cos2 / P - cmean * cmean)),
            "cos_shift": s_shift / P, "etf_distance": etf}


class NC4Accumulator(Accumulator):
    """Second pass for NC4: how often the classifier's argmax equals the nearest class centre.

    Both rules choose among the same kept classes. When labels are given only tokens of a kept
    class count (label ``-1`` and rare classes are skipped); without labels every token counts.

    Args:
        means: (C, D) class means from the first pass (original coordinates).
        classes: (C,) class index of each row of ``means``.
        weight: classifier weight (K, D), row c = class c.
        bias: classifier bias (K,) or None.
        tile: number of tokens scored at once.
        device: where the computation runs.
    """

    _sum_names = ("agree", "total")

    def __init__(self, means: torch.Tensor, classes: torch.Tensor, weight: Any, bias: Any = None,
                 tile: int = 2048, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.means = means.to(self.device, F64)
        self.classes = classes.to(self.device)
        W, b = _check_classifier((weight, bias), self.means.shape[1], self.classes)
        self.W = W[self.classes].to(self.device)
        self.b = None if b is None else b[self.classes].to(self.device)
        self.msq = (self.means * self.means).sum(1)
        self.tile = int(tile)
        self.agree = torch.zeros((), dtype=F64, device=self.device)
        self.total = torch.zeros((), dtype=F64, device=self.device)

    def _config(self) -> dict[str, Any]:
        return {"classes": int(self.classes.numel()), "dim": int(self.means.shape[1])}

    @torch.no_grad()
    def update(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> None:
        """Score one batch of features (labels only select which tokens count)."""
        x, _, lab = check_inputs(x, None, labels)
        x = x.to(self.device, F64)
        if lab is not None:  # only tokens of the kept classes count (as in the first pass)
            x = x[torch.isin(lab.to(self.device), self.classes)]
        for i in range(0, x.shape[0], self.tile):
            xi = x[i:i + self.tile]
            logits = xi @ self.W.T
            if self.b is not None:
                logits = logits + self.b
            ncc = (self.msq[None] - 2 * xi @ self.means.T).argmin(1)
            self.agree += (logits.argmax(1) == ncc).sum()
            self.total += xi.shape[0]

    def compute(self) -> dict[str, float]:
        if float(self.total) == 0:
            raise DataError("NC4: no tokens were scored")
        return {"nc4_agreement": float(self.agree / self.total),
                "nc4_mismatch": 1.0 - float(self.agree / self.total), "nc4_tokens": float(self.total)}


# ---------------------------------------------------------------------------------------------
# per-sequence spectra and cosine


def _group_sequences(x: torch.Tensor, sid: torch.Tensor) -> list[torch.Tensor]:
    order = torch.argsort(sid, stable=True)
    _, counts = torch.unique_consecutive(sid[order], return_counts=True)
    return list(torch.split(x[order], counts.tolist()))


def sequence_eigenvalues(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Descending covariance eigenvalues of each (T, D) sequence (float64, length min(T, D)).

    Uses the T x T Gram matrix when T < D (same non-zero eigenvalues, cheaper), batching the
    sequences of equal length into one ``eigvalsh`` call.
    """
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
    return min(int(torch.searchsorted(cum, torch.tensor([threshold], dtype=cum.dtype))[0]) + 1,
               ev.numel())


class SpectraAccumulator(Accumulator):
    """Per-sequence covariance spectra: k(threshold) averaged over sequences, mean decay curve.

    Sequences with fewer than two tokens are skipped (no covariance). A sequence whose tokens
    are all equal has k = 0 and contributes a zero curve.

    Args:
        dim: feature dimension D (the length of the curves).
        threshold: fraction of variance to explain (0.99 gives k99).
        device: where the sums live.
    """

    _sum_names = ("n_seq", "k_sum", "k_sq", "curve_sum")

    def __init__(self, dim: int, threshold: float = 0.99, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        if not 0 < threshold <= 1:
            raise ConfigError(f"threshold must be in (0, 1], got {threshold}")
        self.dim, self.threshold = int(dim), float(threshold)
        z = lambda *s: torch.zeros(*s, dtype=F64, device=self.device)  # noqa: E731
        self.n_seq, self.k_sum, self.k_sq, self.curve_sum = z(()), z(()), z(()), z(self.dim)
        self.k_min, self.k_max = math.inf, -math.inf

    def _config(self) -> dict[str, Any]:
        return {"dim": self.dim, "threshold": self.threshold}

    def _extra_state(self) -> dict[str, Any]:
        return {"k_min": self.k_min, "k_max": self.k_max}

    def _load_extra(self, sd: dict[str, Any]) -> None:
        self.k_min, self.k_max = sd["k_min"], sd["k_max"]

    def _merge_extra(self, other: "Accumulator") -> None:
        assert isinstance(other, SpectraAccumulator)
        self.k_min, self.k_max = min(self.k_min, other.k_min), max(self.k_max, other.k_max)

    def _all_reduce_extra(self, group: Any) -> None:
        import torch.distributed as dist
        t = torch.tensor([self.k_min, -self.k_max], dtype=F64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        self.k_min, self.k_max = float(t[0]), -float(t[1])

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor) -> None:
        """Add the sequences of one batch (each complete in this batch)."""
        x, sid, _ = check_inputs(x, sequence_ids)
        if x.shape[1] != self.dim:
            raise DataError(f"x has dimension {x.shape[1]}, this accumulator expects {self.dim}")
        seqs = [s for s in _group_sequences(x.to(self.device), sid.to(self.device)) if s.shape[0] >= 2]
        for ev in sequence_eigenvalues(seqs):
            k = k_for_threshold(ev, self.threshold)
            tot = float(ev.sum())
            if tot > 0:
                self.curve_sum[:ev.numel()] += ev / tot
            self.n_seq += 1
            self.k_sum += k
            self.k_sq += k * k
            self.k_min, self.k_max = min(self.k_min, k), max(self.k_max, k)

    def compute(self) -> dict[str, Any]:
        """``k_mean`` (e.g. k99 averaged over sequences), std/min/max and the mean curve."""
        n = float(self.n_seq)
        if n == 0:
            raise DataError("spectra: no sequence with at least two tokens was seen")
        m = float(self.k_sum) / n
        return {"threshold": self.threshold, "n_sequences": n, "k_mean": m,
                "k_std": math.sqrt(max(0.0, float(self.k_sq) / n - m * m)),
                "k_min": float(self.k_min), "k_max": float(self.k_max),
                "sequence_curve": (self.curve_sum / n).tolist()}


class CosineAccumulator(Accumulator):
    """Mean pairwise cosine similarity between tokens of one sequence, averaged over sequences.

    The diagonal (a token with itself) is excluded: for a sequence of T tokens with unit
    vectors u_i the value is (||sum u||^2 - sum ||u_i||^2) / (T (T - 1)). A zero token has
    cosine 0 with every other token. Sequences of one token have no pair and are skipped.

    Args:
        device: where the sums live.
    """

    # The spread of per-sequence cosines is often tiny next to their mean (tokens that share a
    # large common component all have cosine ~1), so E[c^2] - E[c]^2 would cancel to noise. The
    # sums are taken around a reference value ``c0`` (the first batch's mean cosine), re-expressed
    # exactly on merge and all-reduce, the scalar version of the vector shift used above.
    _sum_names = ()  # n_seq and the centred sums are merged together (below), not summed blindly

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        z = lambda: torch.zeros((), dtype=F64, device=self.device)  # noqa: E731
        self.n_seq, self.cos_sum, self.cos_sq = z(), z(), z()  # sums of (c - c0) and (c - c0)^2
        self.c0: Optional[torch.Tensor] = None

    def _recentre(self, c0: torch.Tensor) -> None:
        """Re-express the sums around ``c0``: c - c0 = (c - a) + d with d = a - c0."""
        c0 = c0.to(self.device, F64).clone()
        if self.c0 is not None:
            d = self.c0 - c0
            self.cos_sq = self.cos_sq + 2 * d * self.cos_sum + self.n_seq * d * d
            self.cos_sum = self.cos_sum + self.n_seq * d
        self.c0 = c0

    def _merge_extra(self, other: "Accumulator") -> None:
        assert isinstance(other, CosineAccumulator)
        if other.c0 is None:
            return
        if self.c0 is None:
            self.c0 = other.c0.to(self.device).clone()
        o1, o2, n_o = (t.to(self.device) for t in (other.cos_sum, other.cos_sq, other.n_seq))
        d = other.c0.to(self.device) - self.c0
        self.cos_sq = self.cos_sq + o2 + 2 * d * o1 + n_o * d * d
        self.cos_sum = self.cos_sum + o1 + n_o * d
        self.n_seq = self.n_seq + n_o

    def _all_reduce_extra(self, group: Any) -> None:
        import torch.distributed as dist

        # the lowest rank that has seen a sequence supplies c0; every rank re-centres on it
        rank = torch.tensor([dist.get_rank() if self.c0 is not None else 1 << 30], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MIN, group=group)
        src = int(rank.item())
        if src >= (1 << 30):
            return
        c0 = (self.c0 if self.c0 is not None else torch.zeros((), dtype=F64, device=self.device)).clone()
        dist.broadcast(c0, src=src, group=group)
        self._recentre(c0)
        for t in (self.n_seq, self.cos_sum, self.cos_sq):
            dist.all_reduce(t, group=group)

    def copy(self) -> "Accumulator":
        new = super().copy()
        assert isinstance(new, CosineAccumulator)
        new.n_seq, new.cos_sum, new.cos_sq = self.n_seq.clone(), self.cos_sum.clone(), self.cos_sq.clone()
        new.c0 = None if self.c0 is None else self.c0.clone()
        return new

    def _extra_state(self) -> dict[str, Any]:
        return {"n_seq": self.n_seq.cpu().clone(), "cos_sum": self.cos_sum.cpu().clone(),
                "cos_sq": self.cos_sq.cpu().clone(),
                "c0": None if self.c0 is None else self.c0.cpu().clone()}

    def _load_extra(self, sd: dict[str, Any]) -> None:
        self.n_seq = sd["n_seq"].to(self.device, F64).clone()
        self.cos_sum = sd["cos_sum"].to(self.device, F64).clone()
        self.cos_sq = sd["cos_sq"].to(self.device, F64).clone()
        self.c0 = None if sd.get("c0") is None else sd["c0"].to(self.device, F64).clone()

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor) -> None:
        """Add the sequences of one batch (each complete in this batch)."""
        x, sid, _ = check_inputs(x, sequence_ids)
        sid, S = _dense_ids(sid.to(self.device))
        self._update_prepared(x.to(self.device), sid, S)

    def _update_prepared(self, x: torch.Tensor, sid: torch.Tensor, S: int, y: Optional[torch.Tensor] = None,
                         shift: Optional[torch.Tensor] = None) -> None:
        """``y = x - shift`` in float64 may be given (the geometry accumulator has it): then
        sum_i x_i/||x_i|| = sum_i y_i/||x_i|| + (sum_i 1/||x_i||) shift needs no float64 copy of x."""
        nrm = torch.linalg.vector_norm(x, dim=1, dtype=F64)
        nz = nrm > 0
        inv = torch.where(nz, 1.0 / nrm.clamp_min(1e-300), torch.zeros_like(nrm))
        if y is not None and shift is not None:
            usum = _segment_sum(y, sid, S, inv) + torch.bincount(sid, weights=inv, minlength=S)[:, None] * shift
        else:
            usum = _segment_sum(x, sid, S, inv)
        usq = torch.bincount(sid, weights=nz.to(F64), minlength=S)
        cnt = torch.bincount(sid, minlength=S).to(F64)
        ok = cnt >= 2
        cos = ((usum * usum).sum(1) - usq)[ok] / (cnt[ok] * (cnt[ok] - 1))
        if not bool(ok.any()):
            return
        if self.c0 is None:
            self.c0 = cos.mean()
        dev = cos - self.c0
        self.n_seq += int(ok.sum())
        self.cos_sum += dev.sum()
        self.cos_sq += (dev * dev).sum()

    def compute(self) -> dict[str, float]:
        n = float(self.n_seq)
        if n == 0 or self.c0 is None:
            raise DataError("cosine: no sequence with at least two tokens was seen")
        dm = float(self.cos_sum) / n  # mean deviation from c0
        return {"cosine_mean": float(self.c0) + dm,
                "cosine_std": math.sqrt(max(0.0, float(self.cos_sq) / n - dm * dm)), "n_sequences": n}


# ---------------------------------------------------------------------------------------------
# everything for one layer


class GeometryAccumulator(Accumulator):
    """All measures for one layer: ANOVA, NC on tokens and on sequence means, spectra, cosine.

    Feed it tokens with their sequence ids and either

    - ``class_ids``: the class of each token's sequence (an image label). Gives the three-way
      ANOVA, NC on tokens labelled by their sequence's class, and NC on sequence means; or
    - ``token_classes``: a class per token (a language model's next-token id, ``-1`` where there
      is none). Gives linguistic collapse on tokens; ANOVA is then within vs between sequences.

    Both can be given. The global spectrum comes from the token accumulator's covariance, so the
    d x d update is paid once.

    Args:
        dim: feature dimension.
        min_count: minimum tokens per class for the class-mean measures on tokens.
        threshold: variance fraction for the per-sequence and global k (0.99 = k99).
        spectra: compute per-sequence spectra (an eigen-decomposition per sequence; the costliest
            part after the d x d update).
        cosine: compute the within-sequence cosine.
        tile: block size of the pairwise class computations.
        device: where the sums live.
    """

    def __init__(self, dim: int, min_count: int = 1, threshold: float = 0.99, spectra: bool = True,
                 cosine: bool = True, tile: int = 2048, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.dim, self.min_count, self.threshold = int(dim), int(min_count), float(threshold)
        self.with_spectra, self.with_cosine = bool(spectra), bool(cosine)
        self.anova = AnovaAccumulator(dim, device=device)
        self.tokens = ClassAccumulator(dim, min_count=min_count, tile=tile, device=device)
        self.seq_means = ClassAccumulator(dim, min_count=1, tile=tile, device=device)
        self.spectra = SpectraAccumulator(dim, threshold, device=device) if spectra else None
        self.cosine = CosineAccumulator(device=device) if cosine else None
        self.n_batches = 0

    def _config(self) -> dict[str, Any]:
        return {"dim": self.dim, "min_count": self.min_count, "threshold": self.threshold,
                "spectra": self.with_spectra, "cosine": self.with_cosine}

    def _children(self) -> dict[str, Accumulator]:
        ch: dict[str, Accumulator] = {"anova": self.anova, "tokens": self.tokens, "seq_means": self.seq_means}
        if self.spectra is not None:
            ch["spectra"] = self.spectra
        if self.cosine is not None:
            ch["cosine"] = self.cosine
        return ch

    def _extra_state(self) -> dict[str, Any]:
        return {"n_batches": self.n_batches}

    def _load_extra(self, sd: dict[str, Any]) -> None:
        self.n_batches = int(sd["n_batches"])

    def _merge_extra(self, other: "Accumulator") -> None:
        assert isinstance(other, GeometryAccumulator)
        self.n_batches += other.n_batches

    def _all_reduce_extra(self, group: Any) -> None:
        import torch.distributed as dist
        t = torch.tensor([self.n_batches], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=group)
        self.n_batches = int(t.item())

    @torch.no_grad()
    def update(self, x: torch.Tensor, sequence_ids: torch.Tensor, class_ids: Optional[torch.Tensor] = None,
               token_classes: Optional[torch.Tensor] = None) -> None:
        """Add one batch of tokens.

        Args:
            x: (N, D) tokens (padding already removed).
            sequence_ids: (N,) sequence of each token; sequences are complete within a batch.
            class_ids: (N,) class of each token's sequence, or None.
            token_classes: (N,) per-token class (``-1`` = none), or None (then ``class_ids``).
        """
        x, sid, cid = check_inputs(x, sequence_ids, class_ids, label_name="class_ids")
        if x.shape[1] != self.dim:
            raise DataError(f"x has dimension {x.shape[1]}, this accumulator expects {self.dim}")
        if token_classes is not None:
            _, _, tcl = check_inputs(x[:, :1], None, token_classes, label_name="token_classes")
        else:
            tcl = cid
        has = cid is not None
        if self.anova.has_classes is None:
            self.anova.has_classes = has
        elif self.anova.has_classes != has:
            raise DataError("class_ids were given for some batches and not others")
        if has and int(cid.min()) < 0:
            raise DataError("class_ids must be >= 0 (every sequence needs a class)")
        x = x.to(self.device)
        if self.anova.shift is None and self.tokens.shift is None:
            sh = x.mean(0, dtype=F64)
            self.anova.shift, self.tokens.shift = sh, sh.clone()
        # one shifted float64 copy shared by ANOVA and the class sums (x - shift promotes to
        # float64 in the same pass); the shifts differ only after unusual merges
        y = x - self.anova.shift
        r = torch.linalg.vector_norm(y, dim=1).square()
        dsid, S = _dense_ids(sid.to(self.device))
        ssum = self.anova._update_prepared(y, dsid, S, r, cid)
        if torch.equal(self.tokens.shift, self.anova.shift):
            self.tokens._update_prepared(y, self._labels(tcl, y), r, ssum.sum(0))
        else:
            self.tokens.update(x, tcl)
        if has:
            cnt = torch.bincount(dsid, minlength=S).to(F64)
            means = ssum / cnt[:, None] + self.anova.shift
            scls = torch.zeros(S, dtype=torch.int64, device=x.device).scatter_(0, dsid, cid.to(x.device))
            self.seq_means.update(means, scls)
        if self.spectra is not None:
            self.spectra.update(x, sid)
        if self.cosine is not None:
            if torch.equal(self.tokens.shift, self.anova.shift):
                self.cosine._update_prepared(x, dsid, S, y, self.anova.shift)
            else:
                self.cosine._update_prepared(x, dsid, S)
        self.n_batches += 1

    @staticmethod
    def _labels(tcl: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        if tcl is None:
            return torch.full((y.shape[0],), -1, dtype=torch.int64, device=y.device)
        return tcl.to(y.device)

    def compute(self, classifier: Optional[tuple[Any, Any]] = None) -> dict[str, Any]:
        """Per-layer result: ``anova``, ``nc_tokens``, ``nc_sequence_means``, ``spectra``, ``cosine``.

        Sections that cannot be computed (e.g. NC with fewer than two classes) hold
        ``{"error": message}`` instead of numbers.
        """
        res: dict[str, Any] = {"anova": self.anova.compute()}
        for key, acc, clf in (("nc_tokens", self.tokens, classifier), ("nc_sequence_means", self.seq_means, None)):
            if acc._n_classes_capacity() == 0:
                continue
            try:
                res[key] = acc.compute(clf)
            except DataError as e:
                res[key] = {"error": str(e)}
        cov = self.tokens.covariance()
        ev = torch.linalg.eigvalsh(cov).flip(0).clamp_min(0.0)
        tot = float(ev.sum())
        spec: dict[str, Any] = {"threshold": self.threshold,
                                "global_k": float(k_for_threshold(ev, self.threshold)),
                                "global_spectrum": ev.tolist(),
                                "global_curve": (ev / tot).tolist() if tot > 0 else [0.0] * self.dim}
        if self.spectra is not None:
            try:
                spec.update(self.spectra.compute())
            except DataError as e:
                spec["error"] = str(e)
        res["spectra"] = spec
        if self.cosine is not None:
            try:
                res["cosine"] = self.cosine.compute()
            except DataError as e:
                res["cosine"] = {"error": str(e)}
        return res
