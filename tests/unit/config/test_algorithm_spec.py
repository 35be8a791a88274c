"""The algorithm table: one row per accepted `algorithm.name`, and what code reads from it."""

import dataclasses
import typing

import pytest

from megatron_sdpo.config.algorithm_spec import ALGORITHMS, algorithm_spec
from megatron_sdpo.config.schema import AlgorithmConfig
from megatron_sdpo.errors import ConfigError


def test_table_covers_exactly_the_schema_names():
    hints = typing.get_type_hints(AlgorithmConfig)
    assert set(typing.get_args(hints["name"])) == set(ALGORITHMS)
    assert all(name == spec.name for name, spec in ALGORITHMS.items())


def test_rows():
    grpo, sdpo, stable, hybrid = (algorithm_spec(n) for n in ("grpo", "sdpo", "stable_sdpo", "hybrid"))
    assert (grpo.uses_teacher, grpo.uses_advantages, grpo.distill_mask_key) == (False, True, None)
    assert (sdpo.uses_teacher, sdpo.uses_advantages, sdpo.distill_mask_key) == (True, False, "loss_mask")
    assert (stable.uses_teacher, stable.uses_advantages, stable.distill_mask_key) == (True, False, "loss_mask")
    assert (hybrid.uses_teacher, hybrid.uses_advantages, hybrid.distill_mask_key) == (True, True, "sdpo_mask")
    assert [n for n, s in ALGORITHMS.items() if s.supports_mini_batches] == ["grpo"]
    assert (stable.teacher_mode, stable.requires_teacher_mode) == ("restart_freeze", True)
    assert (sdpo.teacher_mode, sdpo.requires_teacher_mode) == ("ema", False)
    # A distilling algorithm names its mask, a pure RL one has none.
    for s in ALGORITHMS.values():
        assert (s.distill_mask_key is not None) == s.uses_teacher
        assert s.uses_teacher or s.uses_advantages


def test_spec_is_frozen_and_unknown_name_is_a_config_error():
    with pytest.raises(dataclasses.FrozenInstanceError):
        algorithm_spec("grpo").uses_teacher = True  # type: ignore[misc]
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo'.*grpo, sdpo, stable_sdpo, hybrid"):
        algorithm_spec("ppo")


def test_compare_arms_follow_the_table():
    from megatron_sdpo.cli import algorithm_config

    assert algorithm_config("tiny", "grpo")[1] in ([], ["algorithm.name=grpo"])
    ref, ovs = algorithm_config("no_such_preset", "stable_sdpo")
    assert (ref, ovs) == ("no_such_preset", ["algorithm.name=stable_sdpo", "teacher.mode=restart_freeze"])
    assert algorithm_config("no_such_preset", "sdpo")[1] == ["algorithm.name=sdpo", "teacher.mode=ema"]
    assert algorithm_config("no_such_preset", "hybrid")[1] == ["algorithm.name=hybrid"]
