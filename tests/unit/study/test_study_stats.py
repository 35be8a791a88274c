"""The study's statistics against hand-computed cases (the arithmetic is in the comments)."""

import math

import numpy as np
import pytest

from megatron_sdpo.study import inference, stats

# Student-t and normal quantiles as printed in standard tables (5+ significant digits).
TABLE = [
    (0.975, 1, 12.7062),
    (0.975, 2, 4.30265),
    (0.975, 5, 2.57058),
    (0.975, 9, 2.26216),
    (0.975, 30, 2.04227),
    (0.80, 1, 1.37638),
    (0.80, 8, 0.88889),
    (0.80, 9, 0.88340),
    (0.90, 4, 1.53321),
]


@pytest.mark.parametrize("p, df, want", TABLE)
def test_t_quantile_matches_the_table(p, df, want):
    assert stats.t_quantile(p, df) == pytest.approx(want, abs=1e-5 * max(1.0, want))
    assert stats.t_quantile(1 - p, df) == pytest.approx(-want, abs=1e-5 * max(1.0, want))  # symmetry


def test_t_cdf_closed_forms():
    # df = 1 is the Cauchy distribution: F(t) = 1/2 + atan(t)/pi; df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2)).
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_t_quantile_agrees_with_scipy_where_installed():
    sp = pytest.importorskip("scipy.stats")
    for df in (1, 3, 7, 25, 120):
        for p in (0.6, 0.8, 0.975, 0.995):
            assert stats.t_quantile(p, df) == pytest.approx(sp.t.ppf(p, df), rel=1e-9)


def test_normal_quantile():
    assert stats.normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-6)
    assert stats.normal_quantile(0.8) == pytest.approx(0.841621, abs=1e-6)
    assert stats.normal_quantile(0.5) == pytest.approx(0.0, abs=1e-12)


# Six paired differences (arm - GRPO), worked by hand:
#   mean = (0.1 + 0.2 + 0.3 + 0.0 + 0.2 + 0.4) / 6 = 1.2 / 6 = 0.2
#   deviations -0.1, 0, 0.1, -0.2, 0, 0.2; squares sum to 0.01 + 0.01 + 0.04 + 0.04 = 0.10
#   sd = sqrt(0.10 / 5) = sqrt(0.02) = 0.1414214;  se = sd / sqrt(6) = 0.0577350
#   t(0.975, 5) = 2.570582;  half width = 2.570582 * 0.0577350 = 0.1484130
#   interval [0.0515870, 0.3484130]; signs: 5 positive, 0 negative, one exactly 0
CASE = [0.1, 0.2, 0.3, 0.0, 0.2, 0.4]


def test_paired_summary_by_hand():
    s = stats.paired_summary(CASE)
    assert s.n == 6 and s.positive == 5 and s.negative == 0
    assert s.mean == pytest.approx(0.2, abs=1e-12)
    assert s.sd == pytest.approx(math.sqrt(0.02), abs=1e-12)
    assert s.lo == pytest.approx(0.2 - 0.1484130, abs=1e-6)
    assert s.hi == pytest.approx(0.2 + 0.1484130, abs=1e-6)


def test_verdict_rule_by_hand():
    s = stats.paired_summary(CASE)
    # Interval above 0 and 5 of 6 seeds positive.
    assert stats.verdict(s, +1) == stats.ESTABLISHED
    # The paper says the arm is lower: the same data contradict it.
    assert stats.verdict(s, -1) == stats.CONTRADICTED
    assert stats.verdict(s, None) == stats.DESCRIPTIVE
    # The mirror image: interval below 0, 5 of 6 negative.
    mirror = stats.paired_summary([-x for x in CASE])
    assert (stats.verdict(mirror, -1), stats.verdict(mirror, +1)) == (stats.ESTABLISHED, stats.CONTRADICTED)


def test_interval_excluding_zero_is_not_enough_without_five_of_six_seeds():
    # d = 0.5, 0.4, 0.6, 0.5, 0, 0: mean 2.0 / 6 = 0.333333; squared deviations
    # 0.027778 + 0.004444 + 0.071111 + 0.027778 + 0.111111 + 0.111111 = 0.353333, sd = sqrt(0.353333 / 5)
    # = 0.265832, se = 0.108525, half = 2.570582 * 0.108525 = 0.278972: interval [0.054361, 0.612306]
    # excludes 0, but only 4 of 6 seeds are positive (< 5): inconclusive.
    s = stats.paired_summary([0.5, 0.4, 0.6, 0.5, 0.0, 0.0])
    assert s.lo == pytest.approx(0.333333 - 0.278972, abs=1e-5) and s.lo > 0
    assert s.positive == 4
    assert stats.verdict(s, +1) == stats.INCONCLUSIVE


def test_five_of_six_signs_are_not_enough_when_the_interval_holds_zero():
    # d = 0.1, 0.1, 0.1, 0.1, 0.1, -1.0: 5 positive but mean -0.083333 and a wide interval.
    s = stats.paired_summary([0.1] * 5 + [-1.0])
    assert s.positive == 5 and s.lo < 0 < s.hi
    assert stats.verdict(s, +1) == stats.INCONCLUSIVE


def test_share_of_seeds_for_other_counts():
    # 5/6 of n, rounded up: 2 of 2, 3 of 3, 4 of 4 (3.33 -> 4), 9 of 10 (8.33 -> 9), 5 of 6.
    for n, need in [(2, 2), (3, 3), (4, 4), (6, 5), (10, 9), (12, 10)]:
        assert stats.enough_agree(need, n) and not stats.enough_agree(need - 1, n)


def test_one_seed_has_no_interval_and_no_verdict():
    s = stats.paired_summary([0.3])
    assert (s.sd, s.lo, s.hi) == (None, None, None)
    assert stats.verdict(s, +1) == stats.INCONCLUSIVE


def test_two_seeds_established_needs_both_and_the_wide_interval():
    # d = 0.30, 0.32: mean 0.31, sd = 0.0141421, se = 0.01, t(0.975, 1) = 12.7062 -> [0.18294, 0.43706].
    s = stats.paired_summary([0.30, 0.32])
    assert (s.lo, s.hi) == (pytest.approx(0.31 - 0.127062, abs=1e-5), pytest.approx(0.31 + 0.127062, abs=1e-5))
    assert stats.verdict(s, +1) == stats.ESTABLISHED


def test_bootstrap_over_seeds_only_by_hand():
    # Two seeds, differences 0.1 and 0.5, nothing to resample within a seed: the mean of two
    # draws is 0.1 (p = 1/4), 0.3 (1/2) or 0.5 (1/4), so the 2.5% and 97.5% points are 0.1 and 0.5.
    lo, hi = inference.bootstrap([0.1, 0.5], lambda d, draws: d, n_boot=400)
    assert (float(lo), float(hi)) == (pytest.approx(0.1), pytest.approx(0.5))


def test_bootstrap_resamples_items_within_a_seed_by_hand():
    # One seed, four items answered by both arms: arm 1,1,0,0 and baseline 0,1,0,0, so the per-item
    # difference is 1,0,0,0. Drawing 4 items with replacement (the same draw for both arms) gives
    # a mean difference k/4, k ~ Binomial(4, 1/4): P(k=0) = 0.316, P(k<=2) = 0.949, P(k<=3) = 0.996.
    # The 2.5% point is 0 and the 97.5% point 3/4; with 4000 replicates the empirical P(k<=2) is
    # within 0.004 (one SE) of 0.949, seven SEs below 0.975.
    arm, base = np.array([1.0, 1, 0, 0]), np.array([0.0, 1, 0, 0])

    def diff(unit, draws):
        a, b = unit
        idx = draws.get("col", len(a))
        return a[idx].mean() - b[idx].mean()

    for crossed in (True, False):  # one seed: the two designs draw alike
        lo, hi = inference.bootstrap([(arm, base)], diff, crossed=crossed, n_boot=4000)
        assert (float(lo), float(hi)) == (0.0, 0.75)


def test_bootstrap_returns_one_interval_per_metric():
    lo, hi = inference.bootstrap([np.array([0.1, 2.0]), np.array([0.5, 2.0])], lambda d, draws: d, n_boot=400)
    assert lo.shape == (2,) and lo[1] == hi[1] == 2.0 and (lo[0], hi[0]) == (pytest.approx(0.1), pytest.approx(0.5))


def test_seeds_needed_by_hand():
    # sd = detect: n = 9 gives (t(.975,8) + t(.8,8)) / sqrt(9) = (2.30600 + 0.88889) / 3 = 1.0650 > 1;
    # n = 10 gives (2.26216 + 0.88340) / sqrt(10) = 3.14556 / 3.16228 = 0.99471 <= 1.
    assert stats.seeds_needed(0.05, 0.05) == 10
    # Twice the spread: n = 34: (2.03452 + 0.85265) / sqrt(34) * 2 = 0.99029 <= 1; n = 33:
    # (2.03693 + 0.85300) / sqrt(33) * 2 = 1.00615 > 1.
    assert stats.seeds_needed(0.1, 0.05) == 34
    assert stats.seeds_needed(0.0, 0.05) == 2
    # Never below the normal-theory count (z(.975) + z(.8))^2 (sd/d)^2 = 7.849 (sd/d)^2.
    for ratio in (0.5, 1.5, 3.0, 7.0):
        assert stats.seeds_needed(ratio, 1.0) >= 7.849 * ratio**2
    with pytest.raises(ValueError):
        stats.seeds_needed(0.1, 0.0)
