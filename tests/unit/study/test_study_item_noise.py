"""The in-stage gain check against item noise, on hand-computed cases."""

import math

import numpy as np
import pytest

from megatron_sdpo.study import item_noise
from megatron_sdpo.study.findings import load_runs


def _items(correct: int, n: int = 10) -> list[int]:
    return [1] * correct + [0] * (n - correct)


def test_paired_item_se_by_hand():
    # d = after - before = [1, 0, 0, -1]: mean 0, sd sqrt(2/3), se sd/2
    se = item_noise.paired_item_se(np.array([0, 1, 0, 1]), np.array([1, 1, 0, 0]))
    assert se == pytest.approx(math.sqrt(2 / 3) / 2, rel=1e-12)
    assert item_noise.paired_item_se(np.array([1.0]), np.array([0.0])) is None
    assert item_noise.paired_item_se(np.array([1, 0]), np.array([0, 0, 1])) is None


def test_check_gains_by_hand(tmp_path, make_run):
    # Base: 2 of 10 math items right. grpo: 3 right after math in every seed (gain 0.1); the other
    # arm: 3 + extra right. The k newly right items give d_i = 1 on k items, 0 elsewhere:
    # sd = sqrt(k (10 - k) / 90), se = sd / sqrt(10) = sqrt(k (10 - k)) / 30.
    extra = [1, 2, 3, 0, 2, 4]
    entries = []
    for seed, e in enumerate(extra):
        for arm, correct in (("grpo", 3), ("other", 3 + e)):
            root = make_run(
                tmp_path / arm / f"seed{seed}", {"base": {"math/id": _items(2)}, "math": {"math/id": _items(correct)}}
            )
            entries.append((arm, seed, root))
    checks = {c.arm: c for c in item_noise.check_gains(load_runs(entries, {}), ["math", "science"])}
    assert set(checks) == {"grpo", "other"}  # no science stage: no check
    grpo, other = checks["grpo"], checks["other"]
    # grpo: k = 1 every seed, se 0.1 a run, sqrt(6 x 0.01) / 6 for the mean; 0.1 < 3 x 0.0408
    assert grpo.mean == pytest.approx(0.1) and grpo.positive == 6
    assert grpo.item_se == pytest.approx(math.sqrt(6 * 0.01) / 6, rel=1e-9)
    assert not grpo.passed
    # other: k = 2, 3, 4, 1, 3, 5; sum of k (10 - k) = 116; mean gain 0.3 > 3 x sqrt(116) / 180
    assert other.mean == pytest.approx(0.3) and other.positive == 6
    assert other.item_se == pytest.approx(math.sqrt(116) / 180, rel=1e-9)
    assert other.passed
    md = "\n".join(item_noise.markdown(list(checks.values())))
    assert "| other | math | +0.200, +0.300, +0.400, +0.100, +0.300, +0.500 | 6/6 | +0.300 | 0.0598 | yes |" in md


def test_five_of_six_positive_is_needed(tmp_path, make_run):
    entries = []
    for seed, correct in enumerate([9, 9, 9, 9, 1, 1]):  # two seeds lose a base item
        root = make_run(tmp_path / f"s{seed}", {"base": {"math/id": _items(2)}, "math": {"math/id": _items(correct)}})
        entries.append(("a", seed, root))
    (check,) = item_noise.check_gains(load_runs(entries, {}), ["math"])
    assert check.positive == 4 and check.mean > 3 * check.item_se and not check.passed
