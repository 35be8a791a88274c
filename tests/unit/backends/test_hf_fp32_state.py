"""HFBackend with a bf16 model: fp32 master weights for AdamW and an fp32 EMA teacher.

At lr 1e-5 an Adam step (~lr per weight) is far below half a bf16 ULP of a typical weight, and
an EMA step of rate 0.05 towards a student that differs by a few ULPs is too: bf16-only state
does not move. The fp32 state must, and the bf16 teacher must be the one rounding of it.
"""

import pytest
import torch

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.interfaces.blend import TeacherBlend
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3

from backend_losses import WeightedNLL

# One fp32 rounding per lerp on both sides (identical operations): the difference is at most a
# few fp32 ULPs of the weight magnitude.
FP32_RTOL = 4 * torch.finfo(torch.float32).eps
# Rounding to nearest bf16 is off by at most half a ULP = 2**-8 relative (8 stored mantissa bits).
BF16_REL = 2.0**-8


def make_batch(seed: int, B: int = 6, vocab: int = 300) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (B,), generator=g)]
    responses = [
        torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (B,), generator=g)
    ]
    mask = torch.zeros(B, max(len(r) for r in responses))
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1.0
    return SequenceBatch(prompts, responses, None, {"loss_mask": mask, "advantages": torch.randn(B, generator=g)})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny_bf16"), seed=3)


def _bf16_backend(model_dir, **kw) -> HFBackend:
    return HFBackend(model_dir, dtype="bfloat16", lr=1e-5, micro_batch_size=4, seed=0, **kw)


def test_bf16_ema_teacher_tracks_the_fp32_ema_of_the_student(model_dir):
    rate, steps = 0.05, 50
    backend = _bf16_backend(model_dir)
    backend.blend_teacher(TeacherBlend.copy())
    t0 = [t.detach().clone() for _, t in backend.export_weights(model="teacher")]
    ref = [w.detach().clone() for w in backend.fp32_weights("policy")]
    for k in range(steps):
        backend.train_step(make_batch(100 + k % 4), WeightedNLL())
        backend.blend_teacher(TeacherBlend.ema(rate))
        for r, s in zip(ref, backend.fp32_weights("policy"), strict=True):
            r.lerp_(s.detach(), rate)
    shadow = backend.fp32_weights("teacher")
    scale = max(float(r.abs().max()) for r in ref)
    for r, t in zip(ref, shadow, strict=True):
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, r, rtol=0, atol=FP32_RTOL * scale)
    teacher = [t for _, t in backend.export_weights(model="teacher")]
    moved = changed = 0
    for r, t, t_init in zip(ref, teacher, t0, strict=True):
        assert t.dtype == torch.bfloat16
        err = (t.float() - r).abs()
        assert bool((err <= BF16_REL * r.abs() + 1e-30).all()), "the bf16 teacher is not the rounding of the fp32 EMA"
        moved += int((r.to(torch.bfloat16) != t_init).sum())
        changed += int((t != t_init).sum())
    # The student moved far enough that the fp32 EMA rounds to new bf16 values in many places:
    # the bf16 teacher must have moved with it (a bf16-only EMA leaves it where it started).
    assert moved > 0 and changed == moved


def test_bf16_master_weights_take_the_small_steps(model_dir):
    backend = _bf16_backend(model_dir, with_teacher=False)
    before = [m.detach().clone() for m in backend.fp32_weights("policy")]
    backend.train_step(make_batch(7), WeightedNLL())
    after = backend.fp32_weights("policy")
    assert all(m.dtype == torch.float32 for m in after)
    assert sum(int((a != b).sum()) for a, b in zip(after, before, strict=True)) > 0
    # The bf16 model is the rounding of the masters.
    for (_, p), m in zip(backend.export_weights(), after, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_bf16_checkpoint_keeps_masters_and_teacher_shadow(model_dir, tmp_path):
    a = _bf16_backend(model_dir)
    a.train_step(make_batch(1), WeightedNLL())
    a.blend_teacher(TeacherBlend.ema(0.05))
    a.save(str(tmp_path / "ck"))
    m_a = a.train_step(make_batch(2), WeightedNLL())
    a.blend_teacher(TeacherBlend.ema(0.05))

    b = _bf16_backend(model_dir)
    b.load(str(tmp_path / "ck"))
    m_b = b.train_step(make_batch(2), WeightedNLL())
    b.blend_teacher(TeacherBlend.ema(0.05))
    assert m_a == m_b
    for which in ("policy", "teacher"):
        for x, y in zip(a.fp32_weights(which), b.fp32_weights(which), strict=True):
            assert torch.equal(x, y)


def test_base_action_loads_the_base_model_into_the_teacher_and_its_shadow(model_dir):
    backend = _bf16_backend(model_dir)
    base = [t.detach().clone() for _, t in backend.export_weights(model="teacher")]
    backend.configure_optimizer(lr=1e-2, weight_decay=0.1, grad_clip=1.0, lr_schedule=backend.lr_schedule)
    assert backend.lr == 1e-2 and backend.optimizer.param_groups[0]["weight_decay"] == 0.1
    backend.train_step(make_batch(3), WeightedNLL())
    backend.blend_teacher(TeacherBlend.copy())
    assert any(not torch.equal(a, t) for a, (_, t) in zip(base, backend.export_weights(model="teacher"), strict=True))
    backend.blend_teacher(TeacherBlend.base())
    for a, (_, t), s in zip(
        base, backend.export_weights(model="teacher"), backend.fp32_weights("teacher"), strict=True
    ):
        assert torch.equal(a, t) and torch.equal(s, a.float())
