"""LRSchedule: values, validation, megatron-core equivalence and the HF backend using it."""
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
    [(LRSchedule("step"), "style"), (LRSchedule(warmup_steps=-1), "warmup_steps"), (LRSchedule(min_lr_ratio=1.5), "min_lr_ratio")],
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
        ("backend.lr_schedule.warmup_steps=-1", "warmup_steps=-1 must be >= 0"),
        ("backend.lr_schedule.min_lr_ratio=1.5", r"min_lr_ratio=1.5 must be in \[0, 1\]"),
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
        opt, init_lr=0.0, max_lr=peak, min_lr=peak * 0.2 if style != "constant" else 0.0, lr_warmup_steps=warmup,
        lr_decay_steps=total, lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=total,
        wd_incr_style="constant",
    )
    for k in range(total + 3):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr(k, total, peak), rel=1e-12, abs=1e-18), k
        ref.step(1)


def test_hf_backend_follows_the_schedule(tmp_path):
    from test_hf_backend import make_batch

    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3

    from backend_losses import WeightedNLL

    s = LRSchedule("cosine", warmup_steps=1, min_lr_ratio=0.5)
    be = HFBackend(save_tiny_qwen3(tmp_path, seed=0), lr=1e-3, micro_batch_size=8, lr_schedule=s, with_teacher=False)
    be.set_lr_schedule(4)
    got = [be.train_step(make_batch(k), WeightedNLL())["lr"] for k in range(4)]
    assert got == pytest.approx([s.lr(k, 4, 1e-3) for k in range(4)])
    assert got[0] == 0.0 and got[1] == pytest.approx(1e-3)
    be.reset_optimizer()
    be.set_lr_schedule(2)  # a new stage restarts the schedule
    assert be.train_step(make_batch(9), WeightedNLL())["lr"] == 0.0
