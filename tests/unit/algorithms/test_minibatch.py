"""Several optimizer steps per rollout batch: splitting, old log-probs, metrics."""

import pytest
import torch

from megatron_sdpo.algorithms.losses import GRPOLoss
from megatron_sdpo.algorithms.minibatch import combine_step_metrics, split_groups
from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3
from megatron_sdpo.trainer import minibatch_update


def _batch(groups: int = 4, n: int = 4, vocab: int = 300, seed: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            prompts.append(p)
            responses.append(
                torch.randint(3, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            )
    b = SequenceBatch(prompts, responses)
    b.tensors["loss_mask"] = b.response_mask()
    b.tensors["advantages"] = torch.randn(len(b), generator=g)
    return b


def test_split_groups_keeps_whole_groups_in_order():
    b = _batch(groups=4, n=3)
    parts = split_groups(b, 2, 3)
    assert [len(p) for p in parts] == [6, 6]
    assert parts[1].prompt_ids == b.prompt_ids[6:]
    for p in parts:
        torch.testing.assert_close(p.tensors["loss_mask"], p.response_mask())
    with pytest.raises(ConfigError, match="mini-batches"):
        split_groups(b, 3, 3)


def test_combine_step_metrics():
    steps = [
        {"loss": 1.0, "grpo/ratio_max": 1.0, "grpo/ratio_min": 1.0, "skipped": 0.0, "samples": 4.0, "lr": 1.0},
        {"loss": 3.0, "grpo/ratio_max": 1.5, "grpo/ratio_min": 0.7, "skipped": 1.0, "samples": 4.0, "lr": 2.0},
    ]
    assert combine_step_metrics(steps) == {
        "loss": 2.0,
        "grpo/ratio_max": 1.5,
        "grpo/ratio_min": 0.7,
        "skipped": 1.0,
        "samples": 8.0,
        "lr": 2.0,
        "optimizer_steps": 2.0,
    }


def test_four_minibatches_move_the_ratio_and_clip(tmp_path):
    model = save_tiny_qwen3(tmp_path / "m", seed=1)
    # A large lr so that one step moves the policy past the clip range on some tokens.
    be = HFBackend(model, lr=5e-2, micro_batch_size=8, seed=0, with_teacher=False)
    b = _batch(groups=4, n=4)
    before = be.logprobs(b)
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, on_policy=False, dual_clip=3.0)
    m = minibatch_update(be, b, loss, mini_batches=4, group_size=4)
    assert m["optimizer_steps"] == 4.0 and be.step == 4 and m["samples"] == 16.0
    # The old log-probs are the policy's before the first update.
    torch.testing.assert_close(b.tensors["old_logprobs"], before, rtol=0, atol=0)
    assert m["grpo/ratio_max"] > 1.0 or m["grpo/ratio_min"] < 1.0
    assert m["grpo/clip_frac"] > 0.0 and m["grpo/clip_frac_last"] > 0.0
    with pytest.raises(ConfigError, match="on_policy"):
        minibatch_update(be, b, GRPOLoss(on_policy=True), mini_batches=2, group_size=4)
