"""The teacher update as a blend of weight sets (EMA, copy, base, mixtures), applied in place."""

import pytest
import torch

from megatron_sdpo.interfaces.blend import TeacherBlend, blend_, copy_


def _params(seed, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad) for shape in [(5, 3), (7,), (2, 2, 3)]]


def test_ema_matches_the_formula_in_place_without_autograd():
    teacher = _params(0, grad=True)
    student = _params(1, grad=True)
    before = [t.detach().clone() for t in teacher]
    storage = [t.data_ptr() for t in teacher]
    with torch.no_grad():
        blend_(teacher, {"policy": student}, TeacherBlend.ema(0.05))
    for t, b, s, ptr in zip(teacher, before, student, storage, strict=True):
        torch.testing.assert_close(t.detach(), 0.95 * b + 0.05 * s.detach())
        assert t.data_ptr() == ptr and t.grad_fn is None


def test_ema_repeated_with_a_fixed_student_has_the_closed_form():
    teacher, student = _params(2), _params(3)
    t0 = [t.clone() for t in teacher]
    for _ in range(10):
        blend_(iter(teacher), {"policy": iter(student)}, TeacherBlend.ema(0.2))
    for t, a, s in zip(teacher, t0, student, strict=True):
        torch.testing.assert_close(t, s + 0.8**10 * (a - s))


def test_ema_on_a_bf16_teacher_rounds_once_from_fp32():
    teacher = _params(4, torch.bfloat16)
    student = _params(5)  # fp32 student (e.g. master weights)
    want = [(0.9 * t.float() + 0.1 * s).to(torch.bfloat16) for t, s in zip(teacher, student, strict=True)]
    blend_(teacher, {"policy": student}, TeacherBlend.ema(0.1))
    for t, w in zip(teacher, want, strict=True):
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_copy_and_base_are_exact():
    teacher, student, base = _params(6), _params(7), _params(8)
    blend_(teacher, {"policy": student, "reference": base}, TeacherBlend.copy())
    assert all(torch.equal(t, s) for t, s in zip(teacher, student, strict=True))
    blend_(teacher, {"policy": student, "reference": base}, TeacherBlend.base())
    assert all(torch.equal(t, b) for t, b in zip(teacher, base, strict=True))
    copy_(teacher, student)
    assert all(torch.equal(t, s) for t, s in zip(teacher, student, strict=True))


def test_a_three_way_blend_rounds_once_into_a_bf16_teacher():
    teacher, student, base = _params(9, torch.bfloat16), _params(10), _params(11, torch.bfloat16)
    blend = TeacherBlend(policy=0.25, teacher=0.5, reference=0.25)
    want = [(0.5 * t.float() + 0.25 * s + 0.25 * b.float()) for t, s, b in zip(teacher, student, base, strict=True)]
    blend_(teacher, {"policy": student, "reference": base}, blend)
    for t, w in zip(teacher, want, strict=True):
        # fp32 sums of three O(1) terms are within a few fp32 ulps of the exact value, far below
        # half a bf16 ulp except at ties; compare with the one rounding of the fp32 result.
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t.float(), w, atol=0, rtol=2.0**-8)


def test_the_identity_blend_reads_nothing():
    teacher = _params(12)
    before = [t.clone() for t in teacher]
    blend_(teacher, {}, TeacherBlend())
    assert all(torch.equal(t, b) for t, b in zip(teacher, before, strict=True))
    assert TeacherBlend().is_identity and not TeacherBlend.ema(0.1).is_identity


@pytest.mark.parametrize(
    "weights", [dict(policy=0.5), dict(policy=-0.1, teacher=1.1), dict(policy=float("nan"), teacher=0.0)]
)
def test_blend_weights_are_convex(weights):
    with pytest.raises(ValueError, match="sum to 1"):
        TeacherBlend(**weights)


def test_layout_and_source_errors():
    with pytest.raises(ValueError, match="3 tensors"):
        blend_(_params(0), {"policy": _params(1)[:2]}, TeacherBlend.ema(0.1))
    bad = _params(1)
    bad[1] = torch.zeros(8)
    with pytest.raises(ValueError, match="shape"):
        copy_(_params(0), bad)
    with pytest.raises(ValueError, match="reference"):
        blend_(_params(0), {"policy": _params(1)}, TeacherBlend.base())
