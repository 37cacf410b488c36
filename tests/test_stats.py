"""lapheads.stats: Welch's test, its CI, the seeds-needed power calculation, verdicts and the plateau flag."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from lapheads.stats import compare, plateau, seeds_needed, welch


def test_welch_matches_scipy_and_a_hand_computed_interval():
    a = [0.71, 0.74, 0.69, 0.73]
    b = [0.78, 0.75, 0.80]
    w = welch(a, b)
    ref = stats.ttest_ind(b, a, equal_var=False)
    assert w["t"] == pytest.approx(ref.statistic, rel=1e-12)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-12)
    # by hand: Welch-Satterthwaite df and the t quantile
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    diff = np.mean(b) - np.mean(a)
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert w["df"] == pytest.approx(df, rel=1e-12)
    assert w["diff"] == pytest.approx(diff, rel=1e-12)
    assert (w["ci_low"], w["ci_high"]) == pytest.approx((diff - half, diff + half), rel=1e-12)
    ci = ref.confidence_interval(0.95)  # scipy's own Welch interval agrees
    assert (w["ci_low"], w["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-10)


def test_welch_with_no_spread_is_defined():
    assert welch([1.0, 1.0], [1.0, 1.0])["p"] == 1.0
    w = welch([1.0, 1.0], [2.0, 2.0])
    assert w["p"] == 0.0 and w["t"] == math.inf and w["ci_low"] == w["ci_high"] == 1.0
    with pytest.raises(ValueError):
        welch([1.0], [1.0, 2.0])


@pytest.mark.parametrize("d,n", [(0.5, 64), (0.8, 26), (1.0, 17), (2.0, 6)])
def test_seeds_needed_matches_cohens_table(d, n):
    assert seeds_needed(d) == n


def test_seeds_needed_is_the_smallest_n_with_power_0_8():
    d = 1.3
    n = seeds_needed(d)

    def power(k: int) -> float:  # noncentral t, two-sided alpha 0.05, k seeds per setting
        df, nc = 2 * k - 2, d * math.sqrt(k / 2)
        crit = stats.t.ppf(0.975, df)
        return stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)

    assert power(n) >= 0.8 > power(n - 1)
    assert seeds_needed(0.0) is None and seeds_needed(1e-4) is None  # beyond the cap


def test_verdicts_follow_p_and_direction():
    base = [0.50, 0.52, 0.51]
    up = [0.60, 0.61, 0.62]
    assert compare("k=0", base, "all", up, want_lower=False).verdict == "observed"
    assert compare("k=0", base, "all", up, want_lower=True).verdict == "opposite"
    c = compare("k=0", base, "all", [0.505, 0.53, 0.50], want_lower=False)
    assert c.verdict == "not resolved" and c.p >= 0.05
    pooled = math.sqrt((np.var(base, ddof=1) + np.var([0.505, 0.53, 0.50], ddof=1)) / 2)
    assert c.effect_size == pytest.approx(abs(c.diff) / pooled)
    assert c.seeds_needed == seeds_needed(c.effect_size) and c.seeds_needed > 3
    assert "seeds per setting would resolve" in c.describe() and "95% CI" in c.describe()
    single = compare("k=0", [0.5], "all", [0.9, 0.91], want_lower=False)
    assert single.verdict == "single run" and single.p is None and "no test" in single.describe()
    assert compare("k=0", [], "all", [0.9], want_lower=False).verdict == "no data"
    json.dumps(compare("k=0", [1.0, 1.0], "all", [2.0, 2.0], False).to_dict(), allow_nan=False)


def test_plateau_flag():
    steps = list(range(100, 1100, 100))
    rising = [0.1 * i for i in range(1, 11)]
    flat = [0.5, 0.7, 0.8, 0.85, 0.88, 0.9, 0.9, 0.901, 0.902, 0.902]
    assert plateau(steps, rising).status == "no"
    p = plateau(steps, flat)
    # the last 20% of 1000 steps: from step 800 (0.901) to 1000 (0.902)
    assert p.status == "yes" and p.window_start == 800 and p.rel_change == pytest.approx(0.001 / 0.901)
    assert plateau(steps, flat, tol=0.0005).status == "no"
    assert plateau([10, 20], [0.1, 0.1]).status == "unknown"
    assert plateau([10, 20, 30], [0.1, float("nan"), 0.1]).status == "unknown"  # nan points do not count
    # few points: the window always spans at least the last two
    assert plateau([1, 2, 3], [0.1, 0.5, 0.9]).window_start == 2
    # a run stopped by train.until_plateau has plateaued by that rule, even if it ended above its best
    overfit = [2.4, 2.2, 2.1, 2.05, 2.09, 2.11, 2.2]
    assert plateau(steps[:7], overfit).status == "no"
    stopped = plateau(steps[:7], overfit, stopped_at=700)
    assert stopped.status == "yes" and "700" in stopped.describe() and "train.until_plateau" in stopped.describe()


def test_a_curve_that_never_moved_has_not_plateaued():
    """Plateaued needs a move off the first value (in the metric's direction) and then a stop."""
    steps = [2, 4, 6]
    stuck = plateau(steps, [0.078, 0.078, 0.078], mode="max")  # a run at chance: still, but never learned
    assert stuck.status == "no" and stuck.flat and "never moved off its first value, 0.078" in stuck.describe()
    worse = plateau(steps, [0.156, 0.078, 0.078], mode="max")  # it moved, but only the wrong way
    assert worse.status == "no" and worse.flat
    assert plateau(steps, [0.156, 0.078, 0.078]).status == "yes"  # no direction given: any move counts
    rose = plateau(steps, [0.1, 0.5, 0.5], mode="max")
    assert rose.status == "yes" and not rose.flat
    fell = plateau(steps, [2.3, 1.1, 1.1], mode="min")
    assert fell.status == "yes" and not fell.flat
    stopped = plateau(steps, [0.1, 0.1, 0.1], mode="max", stopped_at=6)  # until_plateau stopped a flat run
    assert stopped.status == "no" and stopped.flat


def test_at_chance_is_a_one_sided_binomial_test():
    from scipy.stats import binom

    from lapheads.stats import at_chance

    # 7 of 64 right with 10 classes: P(X >= 7) under chance is well above 0.05
    assert binom.sf(6, 64, 0.1) > 0.05 and at_chance(7 / 64, 0.1, True, 64)
    # 14 of 64: P(X >= 14) < 0.05, above chance
    assert binom.sf(13, 64, 0.1) < 0.05 and not at_chance(14 / 64, 0.1, True, 64)
    assert at_chance(0.1, 0.1, True) and not at_chance(0.11, 0.1, True)  # no n: compared directly
    assert at_chance(2.31, 2.30, False) and not at_chance(2.0, 2.30, False)  # a loss: lower is better


def test_two_seeds_give_statistics_but_no_verdict():
    c = compare("k=0", [0.50, 0.51], "all", [0.60, 0.61], want_lower=False)
    assert c.p < 0.05 and c.verdict == "too few seeds" and c.t is not None
    assert c.describe().endswith("n = 2 vs 2 seeds: no verdict, fewer than 3 seeds per setting")
    three = compare("k=0", [0.50, 0.51, 0.52], "all", [0.60, 0.61, 0.62], want_lower=False)
    assert three.verdict == "observed"
