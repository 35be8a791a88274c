"""Study arms: the built-in paper arms as configs, user arms from YAML and the command line."""

import pytest

from megatron_sdpo.algorithms.teacher import TeacherController
from megatron_sdpo.config import load_config
from megatron_sdpo.config.stages import stage_config
from megatron_sdpo.errors import ConfigError, UserError
from megatron_sdpo.study.arms import BUILTIN_ARMS, arm_overrides, load_arms_file, parse_arm_option, select_arms


def cfg_of(arm, *overrides, seed=3):
    ref, ovs = arm_overrides(BUILTIN_ARMS[arm] if isinstance(arm, str) else arm, "tiny", list(overrides), seed)
    return load_config(ref, ovs)


def test_builtin_arms_are_the_papers():
    assert set(BUILTIN_ARMS) >= {"grpo", "grpo_mb4", "sdpo_frozen", "sdpo_ema5", "stable_sdpo", "sdpo_feedback_off"}
    grpo, mb4 = cfg_of("grpo"), cfg_of("grpo_mb4")
    assert (grpo.algorithm.name, grpo.algorithm.grpo.mini_batches, grpo.seed) == ("grpo", 1, 3)
    assert (mb4.algorithm.name, mb4.algorithm.grpo.mini_batches) == ("grpo", 4)
    frozen = cfg_of("sdpo_frozen")
    assert (frozen.algorithm.name, frozen.teacher.mode) == ("sdpo", "frozen")
    ema = cfg_of("sdpo_ema5")
    assert (ema.teacher.mode, ema.teacher.ema_rate, ema.teacher.reset_at_stage) == ("ema", 0.05, "stage_start")
    off = cfg_of("sdpo_feedback_off")
    assert (off.teacher.mode, off.algorithm.sdpo.context.use_feedback) == ("frozen", False)
    old = cfg_of("sdpo_old_defaults")
    ctx = old.algorithm.sdpo.context
    assert (old.teacher.mode, old.teacher.ema_rate, old.teacher.reset_at_stage) == ("ema", 0.05, "none")
    assert (sorted(ctx.feedback_domains), ctx.feedback_only_without_solution, old.algorithm.grpo.norm_by_std) == (
        ["code", "math", "science", "tooluse"],
        False,
        True,
    )


@pytest.mark.parametrize("steps, gamma", [(30, 20 / 30), (50, 0.4), (20, 1.0), (5, 1.0)])
def test_stable_sdpo_restarts_every_twenty_steps_whatever_the_stage_length(steps, gamma):
    # The EMA horizon 1 / 0.05 = 20 steps: gamma = 20 / steps (the paper's 40% on 50-step stages),
    # capped at 1 (a stage shorter than the horizon restarts only at its start).
    cfg = cfg_of("stable_sdpo", *(f"stages.{k}.steps={steps}" for k in range(4)))
    assert (cfg.algorithm.name, cfg.teacher.mode) == ("stable_sdpo", "restart_freeze")
    for k in range(4):
        t = stage_config(cfg, k).teacher
        assert t.freeze_fraction == pytest.approx(gamma)
        ctl = TeacherController("restart_freeze", freeze_fraction=t.freeze_fraction, stage_steps=steps)
        assert ctl.restart_period == min(20, steps)


def test_study_overrides_come_after_the_arm_and_a_bad_key_names_the_arm():
    cfg = cfg_of("sdpo_frozen", "algorithm.sdpo.alpha=1.0")
    assert cfg.algorithm.sdpo.alpha == 1.0
    with pytest.raises(ConfigError, match=r"^arm sdpo_frozen: unknown config key 'teacher.bogus'"):
        cfg_of("sdpo_frozen", "teacher.bogus=1")


def test_arms_file(tmp_path):
    path = tmp_path / "arms.yaml"
    path.write_text(
        "arms:\n"
        "  frozen_a1: {extends: sdpo_frozen, overrides: {algorithm.sdpo.alpha: 1.0, algorithm.sdpo.add_tail: false}}\n"
        "  listed: {overrides: [algorithm.name=sdpo, teacher.mode=frozen], description: mine}\n"
        "  stable_slow: {extends: stable_sdpo, restart_every: 10}\n"
    )
    arms = load_arms_file(path, BUILTIN_ARMS)
    assert arms["frozen_a1"].overrides == (
        *BUILTIN_ARMS["sdpo_frozen"].overrides,
        "algorithm.sdpo.alpha=1.0",
        "algorithm.sdpo.add_tail=false",
    )
    cfg = cfg_of(arms["frozen_a1"])
    assert (cfg.teacher.mode, cfg.algorithm.sdpo.alpha, cfg.algorithm.sdpo.add_tail) == ("frozen", 1.0, False)
    assert arms["listed"].description == "mine"
    assert arms["stable_slow"].restart_every == 10
    assert stage_config(cfg_of(arms["stable_slow"]), 0).teacher.freeze_fraction == pytest.approx(10 / 30)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a: {overrides: {x.y: 1}, colour: red}", "unknown arm field(s) colour"),
        ("a: {extends: nope}", "unknown arm 'nope'"),
        ("grpo: {overrides: {}}", "already defined"),
        ("a: [1, 2]", "expected a mapping"),
        ("a: {restart_every: 0}", "positive integer"),
        ("a: {overrides: [not-a-pair]}", "list of key=value"),
        ("'a b': {}", "must be letters"),
        ("a: {overrides: {x: [1,}", "invalid YAML"),
        ("[1, 2]", "mapping of arm names"),
    ],
)
def test_bad_arms_file_is_one_line(tmp_path, text, needle):
    path = tmp_path / "arms.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_arms_file(path, BUILTIN_ARMS)


def test_missing_arms_file():
    with pytest.raises(UserError, match="cannot read"):
        load_arms_file("/nonexistent/arms.yaml", BUILTIN_ARMS)


def test_arm_option():
    arm = parse_arm_option("hot:extends=sdpo_ema5,teacher.ema_rate=0.2", dict(BUILTIN_ARMS))
    assert arm.overrides == (*BUILTIN_ARMS["sdpo_ema5"].overrides, "teacher.ema_rate=0.2")
    assert cfg_of(arm).teacher.ema_rate == 0.2
    assert parse_arm_option("s:extends=stable_sdpo,restart_every=5", dict(BUILTIN_ARMS)).restart_every == 5
    for text, needle in [("nocolon", "NAME:key=value"), ("x:a.b", "not key=value"), ("grpo:a=1", "already defined")]:
        with pytest.raises(UserError, match=needle):
            parse_arm_option(text, dict(BUILTIN_ARMS))


def test_select_arms():
    assert [a.name for a in select_arms("sdpo_frozen, grpo", {})] == ["sdpo_frozen", "grpo"]
    with pytest.raises(UserError, match="unknown arm 'ppo'"):
        select_arms("grpo,ppo", {})
    with pytest.raises(UserError, match="twice"):
        select_arms("grpo,grpo", {})
    with pytest.raises(UserError, match="at least one"):
        select_arms(" , ", {})
