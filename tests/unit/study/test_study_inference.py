"""Equivalence, Holm and the bootstrap designs against hand-computed cases."""

import math

import numpy as np
import pytest

from megatron_sdpo.study import inference, stats

CASE = [0.1, 0.2, 0.3, 0.0, 0.2, 0.4]  # test_study_stats.py works it: mean 0.2, sd sqrt(0.02)


def test_t_pvalue_by_hand():
    # t = 0.2 / (sqrt(0.02) / sqrt(6)) = 3.464102; two-sided p with 5 df = 0.0179629 (tables).
    assert inference.t_pvalue(stats.paired_summary(CASE)) == pytest.approx(0.0179629, abs=2e-7)
    assert inference.t_pvalue(stats.paired_summary([0.1])) is None
    assert inference.t_pvalue(stats.paired_summary([0.0, 0.0])) == 1.0


def test_equivalence_by_two_one_sided_tests():
    # mean 0.005, deviations +-0.01 over 6 seeds: sd = sqrt(6 * 1e-4 / 5) = 0.0109545, se = 0.0044721;
    # t(0.95, 5) = 2.015048: the 90% interval 0.005 +- 0.0090116 = [-0.0040, 0.0140] lies in (-0.03, 0.03).
    close = stats.paired_summary([0.015, -0.005, 0.015, -0.005, 0.015, -0.005])
    assert inference.tost_equivalent(close, 0.03)
    assert not inference.tost_equivalent(close, 0.013)  # 0.0140 reaches past a margin of 0.013
    assert inference.verdict_at(close, +1, margin=0.03) == inference.EQUIVALENT
    assert inference.verdict_at(close, +1, margin=None) == stats.INCONCLUSIVE  # no margin: no equivalence
    # TOST at 5% each side reads the 90% interval, not the 95% one: mean 0.01, sd sqrt(0.003) over
    # 6 seeds, se = 0.0223607; 90%: 0.01 -+ 2.015048 * 0.0223607 = [-0.0351, 0.0551], inside +-0.056
    # (but not +-0.054), while the 95% one, 0.01 -+ 2.570582 * 0.0223607 = [-0.0475, 0.0675], is not.
    wide = stats.paired_summary([0.06, -0.04, 0.06, -0.04, 0.06, -0.04])
    assert inference.interval_at(wide, 0.9) == (pytest.approx(-0.035057, abs=1e-5), pytest.approx(0.055057, abs=1e-5))
    assert inference.verdict_at(wide, +1, margin=0.056) == inference.EQUIVALENT
    assert inference.verdict_at(wide, +1, margin=0.054) == stats.INCONCLUSIVE
    # CASE excludes 0 in the paper's direction: established comes first, whatever the margin.
    assert inference.verdict_at(stats.paired_summary(CASE), +1, margin=0.03) == stats.ESTABLISHED
    assert inference.verdict_at(stats.paired_summary(CASE), -1, margin=0.03) == stats.CONTRADICTED
    assert inference.verdict_at(close, None, margin=0.03) == stats.DESCRIPTIVE


def test_a_stricter_level_widens_the_interval_and_can_undo_a_verdict():
    s = stats.paired_summary(CASE)
    assert inference.verdict_at(s, +1, level=0.95) == stats.ESTABLISHED
    # At 1 - 0.05 / 4 = 0.9875: t(0.99375, 5) = 3.8100, half width 0.2200 > 0.2: no longer excludes 0.
    lo, hi = inference.interval_at(s, 0.9875)
    assert lo == pytest.approx(0.2 - 3.810005 * math.sqrt(0.02 / 6), abs=1e-5) and lo < 0
    assert inference.verdict_at(s, +1, level=0.9875) == stats.INCONCLUSIVE


def test_holm_by_hand():
    # Sorted: 0.01 <= 0.05/4 = 0.0125 rejects; 0.03 > 0.05/3 = 0.016667 stops; every later one keeps 0.05/3.
    p = [0.04, 0.01, 0.5, 0.03]
    levels = inference.holm_levels(p)
    assert levels == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 4, 1 - 0.05 / 3, 1 - 0.05 / 3])
    # Adjusted: 4 * 0.01 = 0.04; 3 * 0.03 = 0.09; max(0.09, 2 * 0.04) = 0.09; max(0.09, 0.5) = 0.5.
    assert inference.holm_adjusted(p) == pytest.approx([0.09, 0.04, 0.5, 0.09])
    assert inference.holm_levels([None, 0.001]) == pytest.approx([1 - 0.05, 1 - 0.05])


def test_judge_finding_primary_at_95_and_holm_for_the_secondaries():
    strong, weak = stats.paired_summary(CASE), stats.paired_summary([0.03, 0.05, 0.01, 0.06, 0.02, 0.04])
    out = inference.judge_finding([weak, strong, weak, None], [+1, +1, None, +1], [0.03, 0.03, 0.03, None], primary=0)
    assert out[0].primary and out[0].level == pytest.approx(0.95) and out[0].verdict == stats.ESTABLISHED
    # One tested secondary (the descriptive one and the one without seeds are not): Holm's m = 1.
    assert out[1].level == pytest.approx(0.95) and out[1].verdict == stats.ESTABLISHED
    assert out[2].verdict == stats.DESCRIPTIVE and out[3].verdict == stats.INCONCLUSIVE


def _units(seed_effects, item_effects):
    """Seed s's paired difference on items I: seed_effects[s] + mean(item_effects[I]); every
    seed answers the same items (an exhaustive split)."""
    items = np.asarray(item_effects)

    def paired_diff(s, draws):
        return seed_effects[s] + items[draws.get("col", len(items))].mean()

    return list(range(len(seed_effects))), paired_diff


def test_crossed_bootstrap_is_wider_than_redrawing_items_per_seed():
    rng = np.random.default_rng(1)
    seed_effects = list(0.02 * rng.standard_normal(6))
    item_effects = rng.choice([-0.5, 0.5], size=64)  # items dominate, and are the same for every seed
    units, fn = _units(seed_effects, item_effects)
    crossed = inference.bootstrap(units, fn, crossed=True, n_boot=4000, seed=3)
    nested = inference.bootstrap(units, fn, crossed=False, n_boot=4000, seed=3)
    w_crossed, w_nested = float(crossed[1] - crossed[0]), float(nested[1] - nested[0])
    # By hand: var(replicate mean) = var_s / S + var_i / N crossed, var_s / S + var_i / (N S) nested
    # (S seeds, N items; population variances: the bootstrap draws from the observed values).
    var_s, var_i, S, N = np.var(seed_effects), np.var(item_effects), 6, 64
    z = stats.normal_quantile(0.975)
    assert w_crossed == pytest.approx(2 * z * math.sqrt(var_s / S + var_i / N), rel=0.1)
    assert w_nested == pytest.approx(2 * z * math.sqrt(var_s / S + var_i / (N * S)), rel=0.1)
    assert w_nested < 0.5 * w_crossed  # per-seed redraws average the common item noise away: too narrow
