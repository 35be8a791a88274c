"""LRSchedule: values, validation and megatron-core equivalence (the HF backend stepping it:
tests/unit/backends/test_hf_lr_schedule.py)."""

import math
from types import SimpleNamespace

import pytest

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.schedule import LRSchedule


def test_values_by_hand():
    cos = LRSchedule("cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert [cos.lr(k, 6, 1.0) for k in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert cos.lr(4, 6, 1.0) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert cos.lr(6, 6, 1.0) == pytest.approx(0.1) and cos.lr(9, 6, 1.0) == pytest.approx(0.1)
    lin = LRSchedule("linear")
    assert [lin.lr(k, 4, 2.0) for k in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert LRSchedule().lr(3, 4, 2.0) == 2.0
    # Stage length unknown: warmup, then the peak.
    assert [lin.lr(k, None, 2.0) for k in (0, 7)] == [2.0, 2.0]


@pytest.mark.parametrize(
    "bad, match",
    [
        (LRSchedule("step"), "style"),
        (LRSchedule(warmup_steps=-1), "warmup_steps"),
        (LRSchedule(min_lr_ratio=1.5), "min_lr_ratio"),
    ],
)
def test_malformed_schedules_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        bad.check()


def test_warmup_must_fit_the_stage():
    with pytest.raises(ConfigError, match="smaller than the stage's 3 steps"):
        LRSchedule(warmup_steps=3).check(3)
    LRSchedule(warmup_steps=3).check(0)  # a stage of 0 steps takes none


def test_config_rejects_warmup_longer_than_a_stage():
    from megatron_sdpo.config.loader import load_config

    with pytest.raises(ConfigError, match=r"backend.lr_schedule.warmup_steps=40 .* \(stages.0\)"):
        load_config("tiny", ["backend.lr_schedule.warmup_steps=40"])
    # Counted in optimizer steps: 4 mini-batches a rollout step make room for 39 warmup steps.
    load_config("tiny", ["backend.lr_schedule.warmup_steps=39", "algorithm.grpo.mini_batches=4"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("backend.lr_schedule.warmup_steps=-1", "warmup_steps must be >= 0, got -1"),
        ("backend.lr_schedule.min_lr_ratio=1.5", r"min_lr_ratio must be in \[0, 1\], got 1.5"),
        ("backend.lr_schedule.style=step", "backend.lr_schedule.style"),
    ],
)
def test_config_rejects_a_malformed_schedule(override, match):
    from megatron_sdpo.config.loader import load_config

    with pytest.raises(ConfigError, match=match):
        load_config("tiny", [override])


@pytest.mark.megatron
@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_equals_megatron_optimizer_param_scheduler(style, warmup):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, total, peak = LRSchedule(style, warmup_steps=warmup, min_lr_ratio=0.2), 11, 3e-4
    opt = SimpleNamespace(param_groups=[{}])
    ref = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=peak,
        min_lr=peak * 0.2 if style != "constant" else 0.0,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    for k in range(total + 3):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr(k, total, peak), rel=1e-12, abs=1e-18), k
        ref.step(1)
