"""Statistics behind the report's verdicts: Welch's t-test over seeds, the seeds a test would need,
an at-chance test, and plateau flags for validation curves (definitions and choices:
docs/design/geometry.md, "Statistics")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np

ALPHA = 0.05
POWER = 0.8
MIN_SEEDS = 3  # per setting, for an observed / opposite verdict
MAX_SEEDS = 10_000  # seeds_needed() gives up beyond this (reported as "more than ...")

__all__ = [
    "ALPHA",
    "POWER",
    "MIN_SEEDS",
    "at_chance",
    "Comparison",
    "compare",
    "welch",
    "seeds_needed",
    "Plateau",
    "plateau",
    "evals_without_improvement",
]


def _finite(xs: Sequence[Optional[float]]) -> np.ndarray:
    return np.asarray([float(x) for x in xs if x is not None and math.isfinite(float(x))], dtype=float)


def welch(baseline: Sequence[float], other: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Welch's two-sample t-test of ``other - baseline`` (at least two values each):
    ``{"diff", "ci_low", "ci_high", "t", "df", "p", "se"}``. With zero spread in both, equal means
    give ``t = 0, p = 1`` and a zero-width CI, different means ``t = +-inf, p = 0``."""
    from scipy import stats  # lazy: ~0.7 s to import, reports only

    a, b = _finite(baseline), _finite(other)
    if a.size < 2 or b.size < 2:
        raise ValueError(f"Welch's test needs >= 2 values per group, got {a.size} and {b.size}")
    diff = float(b.mean() - a.mean())
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = float(math.sqrt(va + vb))
    if se == 0.0:
        df, half = float(a.size + b.size - 2), 0.0
        t, p = (0.0, 1.0) if diff == 0.0 else (math.copysign(math.inf, diff), 0.0)
    else:
        df = float((va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)))
        t = diff / se
        half = float(stats.t.ppf(0.5 + confidence / 2, df)) * se
        p = float(2 * stats.t.sf(abs(t), df))
    return {"diff": diff, "ci_low": diff - half, "ci_high": diff + half, "t": t, "df": df, "p": p, "se": se}


def _power(n: int, d: float, alpha: float) -> float:
    from scipy import stats  # lazy: ~0.7 s to import, reports only

    df = 2 * n - 2
    crit = stats.t.ppf(1 - alpha / 2, df)
    nc = d * math.sqrt(n / 2)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seeds_needed(d: float, alpha: float = ALPHA, power: float = POWER, max_n: int = MAX_SEEDS) -> Optional[int]:
    """Seeds per setting for a two-sided two-sample t-test to detect standardised effect ``d``; None
    when ``d`` is 0 / not finite or more than ``max_n`` seeds would be needed."""
    d = abs(float(d))
    if not math.isfinite(d) or d == 0.0:
        return None
    from scipy import stats  # lazy: ~0.7 s to import, reports only

    # from the normal approximation to the exact noncentral-t power, downward then upward
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(2, int(math.ceil(2 * (z / d) ** 2)))
    if n > max_n:
        return None
    while n > 2 and _power(n - 1, d, alpha) >= power:
        n -= 1
    while _power(n, d, alpha) < power:
        n += 1
        if n > max_n:
            return None
    return n


@dataclass
class Comparison:
    """One setting against the baseline on one quantity (:func:`compare`)."""

    baseline: str
    other: str
    n_baseline: int
    n_other: int
    mean_baseline: float
    mean_other: float
    std_baseline: float
    std_other: float
    diff: float
    verdict: str  # "observed" | "opposite" | "not resolved" | "too few seeds" | "at chance" | "single run" | "no data"
    ci_low: Optional[float] = None
    ci_high: Optional[float] = None
    t: Optional[float] = None
    df: Optional[float] = None
    p: Optional[float] = None
    effect_size: Optional[float] = None  # |diff| / pooled std
    seeds_needed: Optional[int] = None  # per setting, for a difference not significant at alpha
    withheld: Optional[str] = None  # why a computed test gives no verdict ("too few seeds", "at chance")

    def withhold(self, verdict: str, why: str) -> None:
        """Give no observed / opposite / not resolved verdict, for the reason ``why`` (a clause)."""
        if self.verdict in ("no data", "single run"):
            return
        self.verdict, self.withheld = verdict, why

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (strict JSON has no inf/nan: those become None)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    def describe(self, digits: int = 3) -> str:
        """One sentence: the difference, its CI, the test, the seeds and the verdict."""

        def f(x: float) -> str:
            return f"{x:+.{digits}g}"

        n = f"n = {self.n_other} vs {self.n_baseline} seeds"
        head = f"{self.other} vs {self.baseline}: difference {f(self.diff)}"
        if self.verdict == "no data":
            return f"{self.other} vs {self.baseline}: no data"
        if self.verdict == "single run":
            return f"{head} ({n}): single run, no test (a test needs >= 2 seeds per setting)"
        assert self.p is not None and self.t is not None and self.df is not None
        t = "inf" if math.isinf(self.t) else f"{self.t:.2f}"
        text = (
            f"{head} [95% CI {f(self.ci_low)}, {f(self.ci_high)}], Welch t = {t} (df {self.df:.1f}), "
            f"p = {self.p:.3g}, {n}: " + (f"no verdict, {self.withheld}" if self.withheld else self.verdict)
        )
        if self.p >= ALPHA and self.verdict != "at chance":
            if self.seeds_needed is not None:
                text += (
                    f" (about {self.seeds_needed} seeds per setting would resolve a difference this size "
                    f"with power {POWER:g} at p < {ALPHA:g})"
                )
            elif self.diff == 0.0:
                text += " (no difference)"
            else:
                text += f" (more than {MAX_SEEDS} seeds per setting would be needed)"
        return text


def compare(
    baseline_label: str,
    baseline: Sequence[Optional[float]],
    other_label: str,
    other: Sequence[Optional[float]],
    want_lower: bool,
    alpha: float = ALPHA,
    min_seeds: int = MIN_SEEDS,
) -> Comparison:
    """Compare per-seed values of ``other`` with ``baseline``; ``want_lower``: the claim predicts a
    lower value for ``other``. With fewer than ``min_seeds`` seeds in a setting the test is
    computed but the verdict is ``"too few seeds"``."""
    a, b = _finite(baseline), _finite(other)
    m0, m1 = (float(v.mean()) if v.size else math.nan for v in (a, b))
    s0, s1 = (float(v.std(ddof=1)) if v.size > 1 else 0.0 for v in (a, b))
    c = Comparison(baseline_label, other_label, int(a.size), int(b.size), m0, m1, s0, s1, m1 - m0, "no data")
    if a.size == 0 or b.size == 0:
        return c
    if a.size < 2 or b.size < 2:
        c.verdict = "single run"
        return c
    w = welch(a, b)
    c.ci_low, c.ci_high, c.t, c.df, c.p = w["ci_low"], w["ci_high"], w["t"], w["df"], w["p"]
    pooled = math.sqrt((s0**2 + s1**2) / 2)
    c.effect_size = abs(c.diff) / pooled if pooled > 0 else (math.inf if c.diff else 0.0)
    if c.p < alpha:
        good = c.diff < 0 if want_lower else c.diff > 0
        c.verdict = "observed" if good else "opposite"
    else:
        c.verdict = "not resolved"
        c.seeds_needed = seeds_needed(c.effect_size, alpha)
    if min(a.size, b.size) < min_seeds:
        c.withhold("too few seeds", f"fewer than {min_seeds} seeds per setting")
    return c


def at_chance(
    value: float, chance: float, higher_is_better: bool, n: Optional[int] = None, alpha: float = ALPHA
) -> bool:
    """Whether a metric is no better than a model that guesses: with ``n``, an accuracy not above
    ``chance`` by a one-sided binomial test at ``alpha``; otherwise no better than ``chance``.

    Args:
        value: the run's value (an accuracy in [0, 1] when ``n`` is given).
        chance: the value of a guess (``1 / classes`` for top-1).
        higher_is_better: the metric's direction.
        n: items the accuracy was measured on (enables the binomial test).
    """
    if n and higher_is_better and 0.0 <= value <= 1.0 and 0.0 < chance < 1.0:
        from scipy import stats  # lazy: ~0.7 s to import, reports only

        hits = int(round(value * n))
        return bool(stats.binomtest(hits, n, chance, alternative="greater").pvalue >= alpha)
    return value <= chance if higher_is_better else value >= chance


@dataclass
class Plateau:
    """Whether a validation curve had flattened at the end of training."""

    status: str  # "yes" | "no" | "unknown"
    rel_change: Optional[float]  # |v_end - v_start| / |v_start| over the window
    points: int  # eval points in the curve
    window_start: Optional[int] = None  # step where the window starts
    stopped_at: Optional[int] = None  # step where train.until_plateau stopped the run (then status "yes")
    first: Optional[float] = None  # the first eval's value
    tol: float = 0.01
    flat: bool = False  # "no" because the curve never moved off its first value

    def describe(self) -> str:
        if self.flat:
            return f"no (never moved off its first value, {self.first:.4g}, by {100 * self.tol:g}% or more)"
        if self.stopped_at is not None:
            return f"yes (stopped by train.until_plateau at step {self.stopped_at})"
        if self.status == "unknown":
            return f"unknown ({self.points} eval point{'s' if self.points != 1 else ''}; needs >= 3)"
        return f"{self.status} ({100 * self.rel_change:.2g}% change since step {self.window_start})"


def plateau(
    steps: Sequence[int],
    values: Sequence[float],
    window: float = 0.2,
    tol: float = 0.01,
    stopped_at: Optional[int] = None,
    mode: Optional[str] = None,
) -> Plateau:
    """Plateau flag of one validation curve: ``"no"`` (``flat``) if it never moved off its first value by
    more than ``tol`` (relative, in the ``mode`` direction); else ``"yes"`` when the relative change
    over the last ``window`` of training (at least two points) is below ``tol`` or
    ``train.until_plateau`` stopped it; ``"unknown"`` with fewer than three points.

    Args:
        steps: the eval steps (any order; sorted here).
        values: the validation metric at those steps (non-finite values are dropped).
        window: fraction of training (by step) at the end over which the change is measured.
        tol: largest relative change that still counts as a plateau.
        stopped_at: the step where ``train.until_plateau`` stopped the run, if it did.
        mode: ``"max"`` / ``"min"``: the curve must have moved off its first value in that
            direction; None: in either.
    """
    if not 0.0 < window <= 1.0:
        raise ValueError(f"window={window} must be in (0, 1]")
    if tol < 0:
        raise ValueError(f"tol={tol} must be >= 0")
    if mode not in (None, "min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min', 'max' or None")
    pts = sorted((int(s), float(v)) for s, v in zip(steps, values) if v is not None and math.isfinite(float(v)))
    first = pts[0][1] if pts else None
    if len(pts) < 3:
        return Plateau("yes" if stopped_at is not None else "unknown", None, len(pts), None, stopped_at, first, tol)
    vals = np.asarray([v for _, v in pts])
    moves = {"max": vals.max() - vals[0], "min": vals[0] - vals.min(), None: np.abs(vals - vals[0]).max()}[mode]
    if not moves > tol * abs(vals[0]):
        return Plateau("no", None, len(pts), None, stopped_at, first, tol, flat=True)
    start = pts[-1][0] * (1.0 - window)  # training starts at step 0
    i0 = min(next(i for i, (s, _) in enumerate(pts) if s >= start), len(pts) - 2)  # at least two points in the window
    s0, v0 = pts[i0]
    v1 = pts[-1][1]
    rel = abs(v1 - v0) / abs(v0) if v0 != 0 else (0.0 if v1 == v0 else math.inf)
    status = "yes" if rel < tol or stopped_at is not None else "no"
    return Plateau(status, rel, len(pts), s0, stopped_at, first, tol)


def evals_without_improvement(values: Sequence[float], mode: str, min_rel_delta: float = 0.0) -> int:
    """How many of the last evals in a row did not improve on the best before them.

    Args:
        values: the validation metric at each eval, in order.
        mode: ``"max"`` (higher is better, accuracy) or ``"min"`` (loss, bits per byte).
        min_rel_delta: an improvement must exceed ``min_rel_delta * |best|``.
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
    vals = [float(v) for v in values]
    best, stale = (vals[0] if vals else 0.0), 0
    for v in vals[1:]:
        margin = min_rel_delta * abs(best)
        better = v > best + margin if mode == "max" else v < best - margin
        if better:
            best, stale = v, 0
        else:
            stale += 1  # as Keras' EarlyStopping: a gain below the margin does not move the best either
    return stale
