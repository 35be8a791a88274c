"""Artifact rates on hand-written responses, and the collapse monitor."""

import json
import logging
import math

import pytest

from megatron_sdpo.diagnostics.artifacts import (
    ArtifactConfig,
    CollapseConfig,
    CollapseMonitor,
    artifact_stats,
    format_token_key,
    repeated_ngram_rate,
)
from megatron_sdpo.errors import ConfigError, DataError

RESPONSES = [
    "so x = 4 and \\boxed{4}",  # one \boxed: fine
    "\\boxed{4} \\boxed{4} \\boxed{4}",  # repeated \boxed
    "<answer>B</answer>",
    "   ",  # empty
    "a b c a b c a b c",  # 3-gram repeats
    "Action: get\nAction Input: {}\nAction: get\nAction Input: {}",
]


def test_repeated_ngram_rate_by_hand():
    # 3-grams of "a b c a b c a b c": abc bca cab abc bca cab abc -> 7 grams, 3 distinct
    assert repeated_ngram_rate("a b c a b c a b c", 3) == pytest.approx(4 / 7)
    assert repeated_ngram_rate("one two three", 3) == 0.0
    assert repeated_ngram_rate("too short", 3) is None


def test_artifact_stats_hand_written_batch():
    got = artifact_stats(
        RESPONSES,
        truncated=[False, True, False, False, True, False],
        token_lengths=[10, 12, 5, 0, 9, 20],
        teacher_mask=[True, False, False, True, True, True],
        config=ArtifactConfig(ngram=3),
    )
    assert got["n"] == 6
    assert got["empty_rate"] == pytest.approx(1 / 6)
    assert got["truncated_rate"] == pytest.approx(2 / 6)
    assert got["teacher_share"] == pytest.approx(4 / 6)
    assert got["mean_tokens"] == pytest.approx(56 / 6)
    assert got["mean_chars"] == pytest.approx(sum(len(r) for r in RESPONSES) / 6)
    assert got["fmt_boxed_repeat_rate"] == pytest.approx(1 / 6)
    assert got["fmt_boxed_present_rate"] == pytest.approx(2 / 6)
    assert got["fmt_boxed_mean_count"] == pytest.approx(4 / 6)
    assert got["fmt_answer_close_repeat_rate"] == 0.0
    assert got["fmt_answer_close_present_rate"] == pytest.approx(1 / 6)
    assert got["fmt_action_repeat_rate"] == pytest.approx(1 / 6)
    # 3-gram rates per response with >= 3 words: r0 "so x = 4 and \boxed{4}" 0; r1 3 words 0;
    # r4 4/7; r5 "Action: get Action Input: {} Action: get Action Input: {}" -> 8 grams, 5 distinct
    rates = [0.0, 0.0, 4 / 7, 3 / 8]
    assert got["repeated_ngram_rate"] == pytest.approx(sum(rates) / 4)
    assert got["repeated_ngram_any"] == pytest.approx(2 / 6)


def test_optional_fields_and_errors():
    got = artifact_stats(["x"], config=ArtifactConfig(format_tokens=("<tool>",)))
    assert "truncated_rate" not in got and "teacher_share" not in got and "mean_tokens" not in got
    assert math.isnan(got["repeated_ngram_rate"])
    assert "fmt_tool_repeat_rate" in got
    with pytest.raises(DataError, match="at least one"):
        artifact_stats([])
    with pytest.raises(DataError, match="truncated has 1 entries for 2"):
        artifact_stats(["a", "b"], truncated=[True])
    with pytest.raises(ConfigError, match="ngram"):
        ArtifactConfig(ngram=0)
    assert format_token_key("\\boxed") == "boxed" and format_token_key("Action:") == "action"


def test_collapse_monitor_alarm_patience_stop_and_marker(tmp_path, caplog):
    marker = tmp_path / "run" / "COLLAPSE.json"
    mon = CollapseMonitor(CollapseConfig(max_format_repeat_rate=0.3, patience=2, stop=True), marker_path=marker)
    healthy = artifact_stats(["\\boxed{1}", "\\boxed{2}", "so \\boxed{3}"])
    sick = artifact_stats(["\\boxed{1}\\boxed{1}", "\\boxed{2}\\boxed{2}", "\\boxed{3}"])
    assert not mon.update(healthy, step=1) and not mon.alarmed
    with caplog.at_level(logging.WARNING):
        alarm = mon.update(sick, step=2)
    assert alarm and alarm.step == 2
    assert alarm.reasons == ["fmt_boxed_repeat_rate=0.667 > 0.300"]
    assert "collapse alarm at step 2" in caplog.text
    assert not mon.should_stop  # patience 2: one alarm is not enough
    assert not mon.update(healthy, step=3)  # a healthy update resets the streak
    mon.update(sick, step=4)
    assert mon.update(sick, step=5) and mon.should_stop
    saved = json.loads(marker.read_text())
    assert [e["step"] for e in saved["events"]] == [2, 4, 5]
    restored = CollapseMonitor(mon.config)
    restored.load_state_dict(mon.state_dict())
    assert restored.should_stop and restored.alarmed


def test_collapse_monitor_does_not_stop_unless_configured():
    mon = CollapseMonitor(CollapseConfig(max_empty_rate=0.1, patience=1, stop=False, min_mean_chars=2.0))
    alarm = mon.update(artifact_stats(["", "", "ok"]))
    assert alarm and not mon.should_stop
    assert any(r.startswith("empty_rate=0.667") for r in alarm.reasons)
    assert any(r.startswith("mean_chars=0.7") for r in alarm.reasons)
    with pytest.raises(ConfigError, match="patience"):
        CollapseConfig(patience=0)
    with pytest.raises(ConfigError, match="max_empty_rate"):
        CollapseConfig(max_empty_rate=1.5)


def test_shrinking_answers_alarm_against_the_stage_start_and_markers_keep_every_stage(tmp_path):
    """Lengths of the SDPO collapse measured on the tiny code stage (mean tokens per step):
    healthy for 3 steps, then shrinking to fragments; GRPO's stay within a few percent."""

    def stats(n_tokens: float) -> dict:
        return {"mean_tokens": n_tokens, "mean_chars": 3 * n_tokens, "empty_rate": 0.0}

    marker = tmp_path / "collapse_alarms.json"
    cfg = CollapseConfig(min_length_ratio=0.6, length_reference_updates=3, patience=2)
    sdpo = CollapseMonitor(cfg, marker_path=marker, label="stage_4_code")
    fired = [
        bool(sdpo.update(stats(n), step=i + 1)) for i, n in enumerate([19.3, 19.2, 19.4, 18.7, 13.8, 10.6, 8.6, 4.2])
    ]
    assert fired == [False] * 5 + [True] * 3  # 0.6 x 19.3 = 11.58: 13.8 passes, 10.6 does not
    assert sdpo.events[0]["reasons"] == ["mean_tokens=10.6 < 0.60 x stage start 19.3"]
    grpo = CollapseMonitor(cfg)
    assert not any(grpo.update(stats(n)) for n in [19.3, 19.3, 19.5, 19.1, 18.9, 19.6, 19.0])
    # A later stage's monitor keeps the earlier stage's events in the marker.
    nxt = CollapseMonitor(cfg, marker_path=marker, label="stage_5_math")
    for i, n in enumerate([10.0, 10.0, 10.0, 2.0]):
        nxt.update(stats(n), step=i + 1)
    saved = json.loads(marker.read_text())["events"]
    assert [(e["label"], e["step"]) for e in saved] == [
        ("stage_4_code", 6),
        ("stage_4_code", 7),
        ("stage_4_code", 8),
        ("stage_5_math", 4),
    ]
    restored = CollapseMonitor(cfg)
    restored.load_state_dict(sdpo.state_dict())
    assert restored.update(stats(5.0))  # the stage-start reference survives a resume
    with pytest.raises(ConfigError, match="min_length_ratio"):
        CollapseConfig(min_length_ratio=1.5)


def test_a_reward_collapse_alarms_against_the_stage_start_and_a_learning_stage_does_not():
    """Mean rewards per step of the tiny code stage, seed 1: the old-defaults control (answers keep
    their form and lose their content) and GRPO, which learns. Reference: the first 3 steps;
    checked once the last 3 steps no longer overlap them."""
    control = [
        0.344,
        0.352,
        0.484,
        0.5,
        0.25,
        0.352,
        0.383,
        0.219,
        0.297,
        0.266,
        0.227,
        0.297,
        0.234,
        0.289,
        0.117,
        0.289,
        0.273,
        0.242,
        0.125,
        0.094,
        0.117,
        0.141,
        0.078,
        0.109,
        0.086,
        0.156,
        0.016,
        0.039,
        0.0,
        0.0,
    ]
    grpo = [
        0.398,
        0.484,
        0.484,
        0.57,
        0.328,
        0.469,
        0.539,
        0.555,
        0.602,
        0.352,
        0.555,
        0.586,
        0.578,
        0.344,
        0.422,
        0.523,
        0.516,
        0.688,
        0.445,
        0.508,
        0.492,
        0.586,
        0.656,
        0.633,
        0.688,
        0.641,
        0.5,
        0.484,
        0.695,
        0.688,
    ]
    cfg = CollapseConfig(min_reward_ratio=0.5, min_reward_drop=0.1, length_reference_updates=3)
    mon = CollapseMonitor(cfg)
    fired = [i + 1 for i, r in enumerate(control) if mon.update({}, step=i + 1, reward=r)]
    # Reference (0.344 + 0.352 + 0.484) / 3 = 0.3933, half 0.1967. Steps 18-20 average
    # (0.242 + 0.125 + 0.094) / 3 = 0.1537 (the first below it; 17-19: 0.2133), and every later
    # window stays below it.
    assert fired == list(range(20, 31))
    assert mon.events[0]["reasons"] == ["reward=0.154 (last 3 steps) < 0.50 x stage start 0.393"]
    mon2 = CollapseMonitor(cfg)
    assert not any(mon2.update({}, reward=r) for r in grpo)
    # A stage that starts near 0 does not alarm on noise: 0.06 -> 0.02 is below half but not 0.1 lower.
    low = CollapseMonitor(cfg)
    assert not any(low.update({}, reward=r) for r in [0.06, 0.05, 0.07, 0.02, 0.01, 0.03, 0.0])
    # Nothing before the two windows stop overlapping, and none without a reward.
    early = CollapseMonitor(cfg)
    assert not any(early.update({}, reward=r) for r in [0.5, 0.5, 0.5, 0.0, 0.0])
    assert early.update({}, reward=0.0)
    assert not CollapseMonitor(cfg).update({}, reward=None)
    assert not CollapseMonitor(CollapseConfig(min_reward_ratio=None)).update({}, reward=0.0)
    restored = CollapseMonitor(cfg)
    restored.load_state_dict(early.state_dict())
    assert restored.update({}, reward=0.0)  # the stage-start reference survives a resume
    with pytest.raises(ConfigError, match="min_reward_ratio"):
        CollapseConfig(min_reward_ratio=0.0)
