"""Class statistics, streamed: Neural Collapse (NC1-NC4), CDNV and linguistic collapse, in memory
O(d^2 + classes x d) with tiled pairwise measures (design and definitions:
docs/design/geometry.md)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..errors import ConfigError, DataError
from .accumulate import F64, Accumulator, check_inputs

__all__ = ["ClassAccumulator", "NC4Accumulator", "check_classifier"]


class ClassAccumulator(Accumulator):
    """Per-class first moments plus the second moment of all tokens (labelled and unlabelled apart),
    in float64, for Neural Collapse.

    Args:
        dim: feature dimension D.
        num_classes: initial size of the class table (grows when a larger label arrives).
        min_count: classes with fewer tokens are left out of the class-mean measures
            (linguistic collapse uses e.g. 10 so rare next tokens do not dominate).
        tile: block size of the pairwise (class x class) computations.
        device: where the sums live.
    """

    _sum_names = ("count", "csum", "csq", "n_lab", "s_lab", "q_lab", "n_unl", "s_unl", "q_unl")

    def __init__(
        self, dim: int, num_classes: int = 0, min_count: int = 1, tile: int = 2048, device: torch.device | str = "cpu"
    ) -> None:
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
            n = max(n, c + c // 4) if c else n
            self.count = torch.cat([self.count, self.count.new_zeros(n - c)])
            self.csq = torch.cat([self.csq, self.csq.new_zeros(n - c)])
            self.csum = torch.cat([self.csum, self.csum.new_zeros(n - c, self.dim)])

    def _move_sums(self, d: torch.Tensor) -> None:
        dd = float(d @ d)
        self.csq = self.csq + 2 * (self.csum @ d) + self.count * dd
        self.csum = self.csum + self.count[:, None] * d
        for n, s, q in (("n_lab", "s_lab", "q_lab"), ("n_unl", "s_unl", "q_unl")):
            N, S, Q = getattr(self, n), getattr(self, s), getattr(self, q)
            Q = Q + torch.outer(S, d) + torch.outer(d, S) + N * torch.outer(d, d)
            setattr(self, q, Q)
            setattr(self, s, S + N * d)

    @torch.no_grad()
    def update(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> None:
        """Add one batch: ``x`` (N, D) and ``labels`` (N,) (``-1`` or None: no class, counted in the
        global covariance only)."""
        x, _, lab = check_inputs(x, None, labels, dim=self.dim)
        y = self._prep(x)
        self._update_prepared(y, lab, torch.linalg.vector_norm(y, dim=1).square(), y.sum(0))

    def _update_prepared(
        self, y: torch.Tensor, lab: Optional[torch.Tensor], r: torch.Tensor, ysum: torch.Tensor
    ) -> None:
        """Add shifted float64 rows ``y`` (labels None: all -1; ``r`` squared norms, ``ysum`` column sum)."""
        # one GEMM over all rows; unlabelled rows go to class 0 and are subtracted again
        if lab is None:
            lab = torch.full((y.shape[0],), -1, dtype=torch.int64, device=y.device)
        lab = lab.to(y.device)
        unl = lab < 0
        n_u = int(unl.sum())
        self.q_lab.addmm_(y.T, y)
        self.s_lab += ysum
        self.n_lab += y.shape[0] - n_u
        if n_u == y.shape[0]:  # nothing labelled: move everything to the unlabelled moments
            self._unlabel(y, ysum, n_u)
            return
        self._grow(int(lab.max()) + 1)
        if n_u:
            yu = y[unl]
            su = yu.sum(0)
            self._unlabel(yu, su, n_u)
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

    def _unlabel(self, yu: torch.Tensor, su: torch.Tensor, n_u: int) -> None:
        """Move rows ``yu`` (column sum ``su``) from the labelled to the unlabelled moments."""
        self.q_lab.addmm_(yu.T, yu, alpha=-1.0)
        self.s_lab -= su
        self.n_unl += n_u
        self.s_unl += su
        self.q_unl.addmm_(yu.T, yu)

    def covariance(self) -> torch.Tensor:
        """Global (population) covariance of the tokens seen, float64 (D, D)."""
        n = float(self.n_lab) + float(self.n_unl)
        if n == 0:
            raise DataError("no tokens were accumulated")
        mu = (self.s_lab + self.s_unl) / n
        return (self.q_lab + self.q_unl) / n - torch.outer(mu, mu)

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
            raise DataError(
                f"Neural Collapse needs at least two classes with >= {self.min_count} "
                f"token(s); got {int(keep.numel())} (labels seen: "
                f"{int((self.count > 0).sum())})"
            )
        cnt = self.count[keep]
        mu = self.csum[keep] / cnt[:, None]
        # within-class average squared distance to the class mean (Galanti's variance)
        var = (self.csq[keep] / cnt - (mu * mu).sum(1)).clamp_min(0.0)
        return keep, cnt, mu, var

    def compute(self, classifier: Optional[tuple[Any, Any]] = None, *, cdnv_only: bool = False) -> dict[str, float]:
        """The Neural Collapse measures (see :func:`lapheads.geometry.neural_collapse`).

        Args:
            classifier: optional ``(weight (K, D), bias (K,) or None)``; row ``c`` of the weight
                is class ``c``'s classifier. Gives NC3 (NC4 needs :meth:`nc4_pass`).
            cdnv_only: compute only the CDNV (skips the d x d eigen-decomposition).
        """
        keep, cnt, mu, var = self._kept()
        C = int(keep.numel())
        M = mu.sub_(mu.mean(0))  # centred class means (C, D), in place
        pair = _pairwise(M, var, self.tile)
        out: dict[str, float] = {
            "n_classes": float(C),
            "n_tokens": float(cnt.sum()),
            "cdnv": pair["cdnv"],
            "n_pairs": pair["n_pairs"],
            "n_pairs_coincident": pair["n_pairs_coincident"],
        }
        if cdnv_only:
            return out
        # pooled within-class scatter over every labelled class (rare ones too)
        allc = torch.nonzero(self.count > 0).flatten()
        # q_lab - sum_c S_c S_c^T / N_c, in row blocks so no second C x D table is built
        scat = self.q_lab.clone()
        for i in range(0, allc.numel(), self.tile):
            idx = allc[i : i + self.tile]
            blk = self.csum[idx] / self.count[idx].sqrt()[:, None]
            scat.addmm_(blk.T, blk, alpha=-1.0)
        sigma_w = scat / self.n_lab
        sigma_b = M.T @ M / C
        evals, evecs = torch.linalg.eigh(sigma_b)
        tol = float(evals.max()) * max(self.dim, C) * torch.finfo(F64).eps
        ok = evals > tol
        V = evecs[:, ok]
        norms = M.norm(dim=1)
        out.update(
            nc1=float(((V.T @ sigma_w @ V).diagonal() / evals[ok]).sum()) / C,
            trace_sigma_w=float(sigma_w.trace()),
            trace_sigma_b=float(sigma_b.trace()),
            within_class_variance=float((var * cnt).sum() / cnt.sum()),
            nc2_equinorm=float(norms.std(unbiased=False) / norms.mean()) if float(norms.mean()) > 0 else float("nan"),
            nc2_equiangular_std=pair["cos_std"],
            nc2_equiangular_mean=pair["cos_mean"],
            nc2_equiangular_shift=pair["cos_shift"],
            nc2_etf_distance=pair["etf_distance"],
        )
        if classifier is not None:
            W, _ = check_classifier(classifier, self.dim, keep)
            Wk = W[keep]
            out["nc3_self_duality"] = float((Wk / Wk.norm() - M / M.norm()).norm())
        return out

    def nc4_pass(self, weight: Any, bias: Any = None) -> "NC4Accumulator":
        """Start the second pass for NC4 with the final class means of this accumulator."""
        keep, means = self.class_means()
        if keep.numel() < 2:
            raise DataError("NC4 needs at least two classes")
        return NC4Accumulator(means, keep, weight, bias, tile=self.tile, device=self.device)


def check_classifier(classifier: Any, dim: int, keep: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(weight, bias)`` or an ``nn.Linear`` as float64 CPU tensors, checked against ``dim`` and
    the largest class in ``keep``."""
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
    """Tiled CDNV (pairs whose means coincide counted apart), cosine equiangularity and ETF distance."""
    C = M.shape[0]
    sq = (M * M).sum(1)
    nrm = sq.sqrt()
    inv_n = torch.where(nrm > 0, 1.0 / nrm.clamp_min(1e-300), torch.zeros_like(nrm))
    s_cdnv = s_cos = s_cos2 = s_shift = 0.0
    n_coincident = 0
    inv = 1.0 / (C - 1)
    for i in range(0, C, tile):
        Mi = M[i : i + tile]
        for j in range(i, C, tile):
            dots = Mi @ M[j : j + tile].T
            d2 = sq[i : i + tile, None] + sq[None, j : j + tile]
            d2.sub_(dots, alpha=2.0).clamp_(min=0.0)
            cos = dots.mul_(inv_n[i : i + tile, None]).mul_(inv_n[None, j : j + tile])
            vv = var[i : i + tile, None] + var[None, j : j + tile]
            # sq_i + sq_j - 2 dot is exact to ~eps (sq_i + sq_j); below 1e-9 of that the means coincide
            apart = d2 > 1e-9 * (sq[i : i + tile, None] + sq[None, j : j + tile])
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
    unit = (nrm > 0).to(M.dtype)  # ||u_c||^2: 1, or 0 for a zero mean
    g2 = float(unit.sum()) + 2 * s_cos2  # ||G||_F^2
    tot = inv_n @ M  # sum of the unit rows
    ge = C / (C - 1) * (float(unit.sum()) - float(tot @ tot) / C)  # <G, E>
    e_norm = C / math.sqrt(C - 1)
    # every class mean zero (e.g. a CLS token no head lets see the image): no simplex to compare with
    etf = math.sqrt(max(0.0, 2.0 - 2.0 * ge / (math.sqrt(g2) * e_norm))) if g2 > 0 else float("nan")
    n_apart = P - n_coincident
    return {
        "cdnv": s_cdnv / n_apart if n_apart else float("nan"),
        "n_pairs": P,
        "n_pairs_coincident": float(n_coincident),
        "cos_mean": cmean,
        "cos_std": math.sqrt(max(0.0, s_cos2 / P - cmean * cmean)),
        "cos_shift": s_shift / P,
        "etf_distance": etf,
    }


class NC4Accumulator(Accumulator):
    """Second pass for NC4: how often the classifier's argmax (weight (K, D), bias (K,) or None) equals
    the nearest of the first pass's class ``means`` (C, D) of ``classes`` (C,), both among those
    classes. With labels only tokens of those classes count; ``tile`` tokens are scored at once."""

    _sum_names = ("agree", "total")

    def __init__(
        self,
        means: torch.Tensor,
        classes: torch.Tensor,
        weight: Any,
        bias: Any = None,
        tile: int = 2048,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(device)
        self.means = means.to(self.device, F64)
        self.classes = classes.to(self.device)
        W, b = check_classifier((weight, bias), self.means.shape[1], self.classes)
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
            xi = x[i : i + self.tile]
            logits = xi @ self.W.T
            if self.b is not None:
                logits = logits + self.b
            ncc = (self.msq[None] - 2 * xi @ self.means.T).argmin(1)
            self.agree += (logits.argmax(1) == ncc).sum()
            self.total += xi.shape[0]

    def compute(self) -> dict[str, float]:
        if float(self.total) == 0:
            raise DataError("NC4: no tokens were scored")
        agree = float(self.agree / self.total)
        return {"nc4_agreement": agree, "nc4_mismatch": 1.0 - agree, "nc4_tokens": float(self.total)}
