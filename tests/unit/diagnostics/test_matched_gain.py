"""KL at matched gain: piecewise-linear reading of hand-built (gain, KL) curves."""

import pytest

from megatron_sdpo.diagnostics.forgetting import EvalMatrix
from megatron_sdpo.diagnostics.matched_gain import gain_kl_curve, kl_at_gain, matched_gain_kl


def test_kl_at_gain_interpolates_at_the_first_crossing():
    a = [(0.0, 0.0), (0.1, 0.02), (0.3, 0.1)]
    # between (0.1, .02) and (0.3, .1): .02 + (0.15 - 0.1) / 0.2 * .08 = .04
    assert kl_at_gain(a, 0.15) == pytest.approx(0.04)
    b = [(0.0, 0.0), (0.2, 0.05), (0.15, 0.06)]
    # first reaches 0.15 on the way up: 0.15 / 0.2 * .05, not the final point's .06
    assert kl_at_gain(b, 0.15) == pytest.approx(0.0375)
    assert kl_at_gain([(0.0, 0.0), (0.15, 0.07)], 0.15) == pytest.approx(0.07)  # exactly at a point
    assert kl_at_gain(a, 0.5) is None and kl_at_gain([], 0.1) is None
    assert kl_at_gain([(0.2, 0.3)], 0.1) is None  # starts above the level: never crossed it


def test_matched_level_is_the_smallest_final_gain():
    curves = {"sdpo": [(0.0, 0.0), (0.1, 0.02), (0.3, 0.1)], "grpo": [(0.0, 0.0), (0.2, 0.05), (0.15, 0.06)]}
    got = matched_gain_kl(curves)
    assert got["level"] == 0.15
    assert got["kl"]["sdpo"] == pytest.approx(0.04) and got["kl"]["grpo"] == pytest.approx(0.0375)
    assert matched_gain_kl(curves, level=0.1)["kl"]["sdpo"] == pytest.approx(0.02)
    # a run that did not improve: no matched level
    flat = matched_gain_kl({**curves, "none": [(0.0, 0.0), (-0.05, 0.01)]})
    assert flat["level"] is None and set(flat["kl"].values()) == {None}


def test_gain_kl_curve_from_matrix_and_drift_records():
    m = EvalMatrix(
        ["base", "math", "code"],
        ["math/id", "code/id"],
        {
            "base": {"math/id": 0.2, "code/id": 0.1},
            "math": {"math/id": 0.5, "code/id": 0.1},
            "code": {"math/id": 0.4, "code/id": 0.3},
        },
    )
    drift = [
        {"stage": 1, "excess_kl": {"math/id": {"kl_k3": 0.04}}},
        {"stage": 2, "excess_kl": {"code/id": {"kl_k3": 0.07}, "math/id": {"kl_k3": 0.09}}},
    ]
    assert gain_kl_curve(m, drift, "math") == [(0.0, 0.0), pytest.approx((0.3, 0.04))]
    assert gain_kl_curve(m, drift, "code") == [(0.0, 0.0), pytest.approx((0.2, 0.07))]
    assert gain_kl_curve(m, drift, "tooluse") == []
