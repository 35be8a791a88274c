"""Teacher weight updates (EMA, copy) and the teacher schedules."""
import pytest
import torch

from megatron_sdpo.algorithms.teacher import TeacherController, copy_, ema_update_
from megatron_sdpo.errors import ConfigError


def _params(seed, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad) for shape in [(5, 3), (7,), (2, 2, 3)]]


def test_ema_matches_the_formula_in_place_without_autograd():
    teacher = _params(0, grad=True)
    student = _params(1, grad=True)
    before = [t.detach().clone() for t in teacher]
    storage = [t.data_ptr() for t in teacher]
    ema_update_(teacher, student, 0.05)
    for t, b, s, ptr in zip(teacher, before, student, storage):
        torch.testing.assert_close(t.detach(), 0.95 * b + 0.05 * s.detach())
        assert t.data_ptr() == ptr and t.grad_fn is None


def test_ema_repeated_with_a_fixed_student_has_the_closed_form():
    teacher, student = _params(2), _params(3)
    t0 = [t.clone() for t in teacher]
    for _ in range(10):
        ema_update_(iter(teacher), iter(student), 0.2)
    for t, a, s in zip(teacher, t0, student):
        torch.testing.assert_close(t, s + 0.8**10 * (a - s))


def test_ema_on_a_bf16_teacher_rounds_once_from_fp32():
    teacher = _params(4, torch.bfloat16)
    student = _params(5)  # fp32 student (e.g. master weights)
    want = [(0.9 * t.float() + 0.1 * s).to(torch.bfloat16) for t, s in zip(teacher, student)]
    ema_update_(teacher, student, 0.1)
    for t, w in zip(teacher, want):
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_copy():
    teacher, student = _params(6), _params(7)
    copy_(teacher, student)
    for t, s in zip(teacher, student):
        assert torch.equal(t, s)


def test_layout_and_rate_errors():
    with pytest.raises(ValueError, match="3 tensors"):
        ema_update_(_params(0), _params(1)[:2], 0.1)
    bad = _params(1)
    bad[1] = torch.zeros(8)
    with pytest.raises(ValueError, match="shape"):
        copy_(_params(0), bad)
    with pytest.raises(ConfigError, match="rate"):
        ema_update_(_params(0), _params(1), 1.5)


def _run(ctrl, stages):
    log = []
    for steps in stages:
        log.append(ctrl.on_stage_start(steps))
        log.append([ctrl.after_step(k) for k in range(1, steps + 1)])
    return log


def test_ema_schedule():
    assert _run(TeacherController("ema", ema_rate=0.05), [3, 2]) == ["copy", ["ema"] * 3, "none", ["ema"] * 2]
    reset = TeacherController("ema", ema_rate=0.05, reset_at_stage="stage_start")
    assert _run(reset, [1, 1]) == ["copy", ["ema"], "copy", ["ema"]]
    base = TeacherController("ema", ema_rate=0.05, reset_at_stage="base")
    assert _run(base, [1, 1]) == ["copy", ["ema"], "base", ["ema"]]
    frozen_base = TeacherController("frozen", reset_at_stage="base")
    assert _run(frozen_base, [1, 1]) == ["copy", ["none"], "base", ["none"]]
    with pytest.raises(ConfigError, match="reset_at_stage"):
        TeacherController("ema", reset_at_stage="always")


def test_frozen_schedule():
    assert _run(TeacherController("frozen"), [3, 2]) == ["copy", ["none"] * 3, "copy", ["none"] * 2]


def test_restart_freeze_schedule():
    ctrl = TeacherController("restart_freeze", freeze_fraction=0.4, stage_steps=10)
    assert ctrl.restart_period == 4
    log = _run(ctrl, [10])
    assert log[0] == "copy"
    assert [k for k, a in enumerate(log[1], start=1) if a == "copy"] == [4, 8]
    ctrl = TeacherController("restart_freeze", freeze_fraction=0.4, stage_steps=100)
    assert ctrl.restart_period == 40  # not 41: 0.4 * 100 is 40.000000000000004 in floating point
    log = _run(ctrl, [100, 7])
    assert [k for k, a in enumerate(log[1], start=1) if a == "copy"] == [40, 80]
    assert log[2] == "copy" and ctrl.restart_period == 3
    assert [k for k, a in enumerate(log[3], start=1) if a == "copy"] == [3, 6]
    assert ctrl.num_copies == 1 + 2 + 1 + 2
    # no restart after the stage's last step: nothing would train against that teacher
    half = TeacherController("restart_freeze", freeze_fraction=0.5, stage_steps=10)
    assert [k for k, a in enumerate(_run(half, [10])[1], start=1) if a == "copy"] == [5]


def test_resume_mid_stage_continues_the_same_schedule():
    full = TeacherController("restart_freeze", freeze_fraction=0.3, stage_steps=10)
    ref = _run(full, [10])
    first = TeacherController("restart_freeze", freeze_fraction=0.3, stage_steps=10)
    first.on_stage_start()
    actions = [first.after_step(k) for k in range(1, 5)]
    resumed = TeacherController("restart_freeze", freeze_fraction=0.3, stage_steps=10)
    resumed.load_state_dict(first.state_dict())
    actions += [resumed.after_step(k) for k in range(5, 11)]
    assert actions == ref[1]
    assert resumed.state_dict() == full.state_dict()
    other = TeacherController("ema", ema_rate=0.05)
    with pytest.raises(ConfigError, match="mode"):
        other.load_state_dict(first.state_dict())


def test_controller_argument_errors():
    with pytest.raises(ConfigError, match="mode"):
        TeacherController("live")
    with pytest.raises(ConfigError, match="ema_rate"):
        TeacherController("ema", ema_rate=0.0)
    with pytest.raises(ConfigError, match="freeze_fraction"):
        TeacherController("restart_freeze", freeze_fraction=1.2, stage_steps=5)
    with pytest.raises(ConfigError, match="stage_steps"):
        TeacherController("frozen", stage_steps=0)
    ctrl = TeacherController("frozen", stage_steps=5)
    with pytest.raises(RuntimeError, match="on_stage_start"):
        ctrl.after_step(1)
    ctrl.on_stage_start()
    with pytest.raises(ValueError, match="expected step 1"):
        ctrl.after_step(2)
