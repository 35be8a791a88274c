"""The HF backend steps the LR schedule (interfaces/schedule.py) per optimizer step and restarts it
at every stage."""

import pytest
from test_hf_backend import make_batch

from megatron_sdpo.interfaces.schedule import LRSchedule

from backend_losses import WeightedNLL


def test_hf_backend_follows_the_schedule(tmp_path):
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3

    s = LRSchedule("cosine", warmup_steps=1, min_lr_ratio=0.5)
    be = HFBackend(save_tiny_qwen3(tmp_path, seed=0), lr=1e-3, micro_batch_size=8, lr_schedule=s, with_teacher=False)
    be.set_lr_schedule(4)
    got = [be.train_step(make_batch(k), WeightedNLL())["lr"] for k in range(4)]
    assert got == pytest.approx([s.lr(k, 4, 1e-3) for k in range(4)])
    assert got[0] == 0.0 and got[1] == pytest.approx(1e-3)
    be.reset_optimizer()
    be.set_lr_schedule(2)  # a new stage restarts the schedule
    assert be.train_step(make_batch(9), WeightedNLL())["lr"] == 0.0
