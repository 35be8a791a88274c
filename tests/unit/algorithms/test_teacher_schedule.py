"""The teacher schedules: which blend (interfaces/blend.py) to apply at stage starts and steps."""

import pytest

from megatron_sdpo.algorithms.teacher import TeacherController
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.blend import TeacherBlend

_NAMES = {TeacherBlend(): "none", TeacherBlend.copy(): "copy", TeacherBlend.base(): "base"}


def _name(blend: TeacherBlend) -> str:
    if blend in _NAMES:
        return _NAMES[blend]
    assert blend == TeacherBlend.ema(blend.policy), blend
    return "ema"


def _run(ctrl, stages):
    log = []
    for steps in stages:
        log.append(_name(ctrl.on_stage_start(steps)))
        log.append([_name(ctrl.after_step(k)) for k in range(1, steps + 1)])
    return log


def test_ema_schedule():
    assert _run(TeacherController("ema", ema_rate=0.05), [3, 2]) == ["copy", ["ema"] * 3, "none", ["ema"] * 2]
    reset = TeacherController("ema", ema_rate=0.05, reset_at_stage="stage_start")
    assert _run(reset, [1, 1]) == ["copy", ["ema"], "copy", ["ema"]]
    base = TeacherController("ema", ema_rate=0.05, reset_at_stage="base")
    assert _run(base, [1, 1]) == ["copy", ["ema"], "base", ["ema"]]
    frozen_base = TeacherController("frozen", reset_at_stage="base")
    assert _run(frozen_base, [1, 1]) == ["copy", ["none"], "base", ["none"]]


def test_ema_blends_at_the_stage_rate():
    ctrl = TeacherController("ema", ema_rate=0.05)
    ctrl.on_stage_start(2)
    assert ctrl.after_step(1) == TeacherBlend(policy=0.05, teacher=0.95)
    ctrl.configure(ema_rate=0.01, freeze_fraction=0.4, reset_at_stage="none")  # a stage's override
    ctrl.on_stage_start(2)
    assert ctrl.after_step(1) == TeacherBlend(policy=0.01, teacher=0.99)


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
    actions = [_name(first.after_step(k)) for k in range(1, 5)]
    resumed = TeacherController("restart_freeze", freeze_fraction=0.3, stage_steps=10)
    resumed.load_state_dict(first.state_dict())
    actions += [_name(resumed.after_step(k)) for k in range(5, 11)]
    assert actions == ref[1]
    assert resumed.state_dict() == full.state_dict()
    other = TeacherController("ema", ema_rate=0.05)
    with pytest.raises(ConfigError, match="mode"):
        other.load_state_dict(first.state_dict())


def test_controller_argument_errors():
    # The settings' bounds are checked once, with the config (tests/unit/config).
    with pytest.raises(ConfigError, match="stage_steps"):
        TeacherController("frozen", stage_steps=0)
    ctrl = TeacherController("frozen", stage_steps=5)
    with pytest.raises(RuntimeError, match="on_stage_start"):
        ctrl.after_step(1)
    ctrl.on_stage_start()
    with pytest.raises(ValueError, match="expected step 1"):
        ctrl.after_step(2)
