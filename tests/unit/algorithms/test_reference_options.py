"""The paper code's options ported here, against their formulas: random token masking of the
distillation loss (`mask_ratio`), the teacher initialisation blend (`teacher_init_alpha`), the
schedules of an initialised and of a trust-region teacher, and their config checks."""

import math

import pytest
import torch

from megatron_sdpo.algorithms.sdpo import random_token_keep
from megatron_sdpo.algorithms.teacher import TeacherController
from megatron_sdpo.config import load_config
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.blend import TeacherBlend, blend_


def test_mask_ratio_zero_keeps_every_token_without_drawing():
    state = torch.random.get_rng_state()
    assert torch.equal(random_token_keep((3, 5), 0.0, seed=1), torch.ones(3, 5))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_mask_ratio_is_the_reference_formula_from_its_own_seeded_stream():
    shape, r = (4, 7), 0.3
    want = (torch.rand(shape, generator=torch.Generator().manual_seed(11), dtype=torch.float32) >= r).float()
    state = torch.random.get_rng_state()
    got = random_token_keep(shape, r, seed=11)
    assert torch.equal(got, want) and torch.equal(random_token_keep(shape, r, seed=11), got)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global stream did not move
    assert not torch.equal(random_token_keep((64, 64), r, seed=12), random_token_keep((64, 64), r, seed=11))


@pytest.mark.parametrize("r", [0.1, 0.5, 0.9])
def test_mask_ratio_keeps_one_minus_the_ratio(r):
    n = 200_000
    kept = float(random_token_keep((n,), r, seed=5).mean())
    # Binomial(n, 1 - r) share: 6 standard deviations.
    assert abs(kept - (1.0 - r)) < 6.0 * math.sqrt(r * (1.0 - r) / n)


def test_mask_ratio_bounds():
    with pytest.raises(ConfigError, match="mask_ratio"):
        random_token_keep((2,), 1.0, seed=0)
    with pytest.raises(ConfigError, match="mask_ratio must be in"):
        load_config("tiny_sdpo", ["algorithm.sdpo.mask_ratio=1.0"])
    with pytest.raises(ConfigError, match="mask_ratio must be in"):
        load_config("tiny_sdpo", ["algorithm.sdpo.mask_ratio=-0.1"])
    assert load_config("tiny_sdpo", ["algorithm.sdpo.mask_ratio=0.5"]).algorithm.sdpo.mask_ratio == 0.5


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_init_blend_is_alpha_checkpoint_plus_one_minus_alpha_student(alpha):
    g = torch.Generator().manual_seed(0)
    ckpt = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    student = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    teacher = [c.clone() for c in ckpt]  # the teacher holds the checkpoint
    blend = TeacherBlend.init(alpha)
    assert (blend.policy, blend.teacher, blend.reference) == (1.0 - alpha, alpha, 0.0)
    blend_(teacher, {"policy": student}, blend)
    for t, c, s in zip(teacher, ckpt, student, strict=True):
        torch.testing.assert_close(
            t, alpha * c + (1.0 - alpha) * s, rtol=0, atol=4 * torch.finfo(torch.float32).eps * 8
        )
    assert TeacherBlend.init(1.0).is_identity


def test_an_initialised_teacher_is_kept_at_the_first_stage_start_only():
    c = TeacherController("frozen", stage_steps=4, init_teacher=True)
    assert c.on_stage_start().is_identity  # the backend built it from the checkpoint
    assert c.on_stage_start() == TeacherBlend.copy()  # a frozen teacher copies at later starts
    e = TeacherController("ema", ema_rate=0.1, stage_steps=4, init_teacher=True)
    assert e.on_stage_start().is_identity and e.after_step(1) == TeacherBlend.ema(0.1)


def test_trust_region_weights_behave_as_frozen():
    c = TeacherController("trust_region", ema_rate=0.05, stage_steps=3)
    assert c.on_stage_start() == TeacherBlend.copy()
    assert all(c.after_step(k).is_identity for k in (1, 2, 3))
    assert c.on_stage_start() == TeacherBlend.copy()


def test_teacher_options_are_checked_with_the_config():
    cfg = load_config(
        "tiny_sdpo", ["teacher.mode=trust_region", "teacher.init_path=some/dir", "teacher.init_alpha=0.5"]
    )
    assert (cfg.teacher.mode, cfg.teacher.init_path, cfg.teacher.init_alpha) == ("trust_region", "some/dir", 0.5)
    with pytest.raises(ConfigError, match="init_alpha must be in"):
        load_config("tiny_sdpo", ["teacher.init_alpha=1.5"])
    with pytest.raises(ConfigError, match="kernel.fused_kl=false"):
        load_config("tiny_sdpo", ["teacher.mode=trust_region", "kernel.fused_kl=true"])


def test_the_trust_region_mix_has_its_own_key_and_the_old_spelling_is_one_line():
    cfg = load_config("tiny_sdpo", ["teacher.mode=trust_region", "teacher.trust_region_mix=0.2"])
    assert (cfg.teacher.trust_region_mix, cfg.teacher.ema_rate) == (0.2, 0.05)
    for overrides, where in (
        (["teacher.ema_rate=0.2"], "teacher.ema_rate=0.2"),
        (["stages.3.teacher.ema_rate=0.01"], "stages.3.teacher.ema_rate"),
    ):
        with pytest.raises(ConfigError) as exc:
            load_config("tiny_sdpo", ["teacher.mode=trust_region", *overrides])
        msg = str(exc.value)
        assert msg.startswith(where) and "teacher.trust_region_mix" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="trust_region_mix must be in"):
        load_config("tiny_sdpo", ["teacher.mode=trust_region", "teacher.trust_region_mix=1.5"])
    with pytest.raises(ConfigError, match="cannot change between stages"):  # one coefficient per run
        load_config("tiny_sdpo", ["teacher.mode=trust_region", "stages.3.teacher.trust_region_mix=0.1"])


@pytest.mark.parametrize("override", ["teacher.mode=trust_region", "teacher.init_path=some/dir"])
def test_megatron_rejects_the_options_it_does_not_implement(override):
    with pytest.raises(
        ConfigError, match=r"needs backend.name=hf \(the megatron backend does not implement it\)"
    ) as exc:
        load_config("qwen3_4b_frozen", [override])
    assert "\n" not in str(exc.value)
    # Random token masking is a mask in the batch: both backends read it.
    assert load_config("qwen3_4b_frozen", ["algorithm.sdpo.mask_ratio=0.2"]).algorithm.sdpo.mask_ratio == 0.2
