"""The loss registry and the spec table name the same algorithms, and each built loss is what
its spec says (a teacher's distillation, a policy-gradient term reading advantages)."""

import pytest

from megatron_sdpo.algorithms import losses
from megatron_sdpo.algorithms.registry import LOSS_BUILDERS, build_loss
from megatron_sdpo.config import load_config
from megatron_sdpo.config.algorithm_spec import ALGORITHMS
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import LossFn


def test_the_registry_and_the_spec_table_name_the_same_algorithms():
    assert set(LOSS_BUILDERS) == set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_loss_is_what_its_spec_says(name):
    spec = ALGORITHMS[name]
    cfg = load_config("tiny_sdpo", [f"algorithm.name={name}", f"teacher.mode={spec.teacher_mode or 'ema'}"])
    loss = build_loss(cfg, topk_source="logits")
    assert isinstance(loss, LossFn)
    assert (loss.distillation is not None) == spec.uses_teacher
    if spec.uses_teacher:
        assert loss.distillation.mask_key == spec.distill_mask_key
    # The policy-gradient term (the one reading advantages): the loss itself or the hybrid's part.
    has_pg = isinstance(loss, losses.GRPOLoss) or isinstance(getattr(loss, "grpo", None), losses.GRPOLoss)
    assert has_pg == spec.uses_advantages


def test_an_unknown_name_is_one_line():
    cfg = load_config("tiny")
    object.__setattr__(cfg.algorithm, "name", "ppo")
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo'; known: grpo, sdpo"):
        build_loss(cfg, topk_source="logits")
