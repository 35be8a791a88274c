"""The study's per-run metrics on a hand-made run: base, then math, tooluse and code stages, four
eval items per column (the expected numbers are worked out in the comments)."""

import json
import math

import numpy as np
import pytest

from megatron_sdpo.study import metrics as M

COLUMNS = ("math/id", "tooluse/id", "code/id", "math/ood_mid")
# A row's item scores, column by column in COLUMNS' order. ID accuracies of the rows base, math,
# tooluse, code: math/id 0.25, 0.75, 0.5, 0.5; tooluse/id 0, .25, .75, .25; code/id 0, 0, .25, .5.
ROWS = {
    "base": ([0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]),
    "math": ([1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]),
    "tooluse": ([1, 0, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]),
    "code": ([1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]),
}
ITEMS = {row: dict(zip(COLUMNS, items, strict=True)) for row, items in ROWS.items()}
REWARDS = [(0, "math", [0.2, 0.4]), (1, "tooluse", [0.5]), (2, "code", [0.1, 0.2, 0.3])]
DRIFT = {
    "param_vs_base": {"summary": {"mean_spectral_shift": 0.004, "mean_angle_max_deg": 2.5}},
    "response_cosine_mean": 0.93,
    "excess_kl_mean_k3": 0.1,
}


@pytest.fixture
def view(tmp_path, make_run):
    return M.RunView(make_run(tmp_path / "run", ITEMS, REWARDS, DRIFT))


def test_metrics_by_hand(view):
    got = M.run_metrics(view)
    # In-stage gains: math 0.75 - 0.25, tooluse 0.75 - 0.25, code 0.5 - 0.25; mean 1.25 / 3.
    assert got["in_stage_gain/math"] == pytest.approx(0.5)
    assert got["in_stage_gain/code"] == pytest.approx(0.25)
    assert got["in_stage_gain"] == pytest.approx(1.25 / 3)
    assert got["in_stage_gain/science"] is None  # never trained
    # Backward transfer (final - just after its own stage): math 0.5 - 0.75, tooluse 0.25 - 0.75;
    # code is the last stage and is left out of the mean.
    assert got["backward_transfer/math"] == pytest.approx(-0.25)
    assert got["backward_transfer/tooluse"] == pytest.approx(-0.5)
    assert got["backward_transfer"] == pytest.approx(-0.375)
    # Forgetting (best from its stage on - final): math max(.75, .5) - .5, tooluse .75 - .25.
    assert got["forgetting"] == pytest.approx((0.25 + 0.5) / 2)
    # Final in-domain average over the three domains with an id column.
    assert got["final_avg_id"] == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert got["final_id/tooluse"] == pytest.approx(0.25)
    # OOD mid (math's ood_mid column): final 0.25 - base 0.5.
    assert got["ood_change/mid"] == pytest.approx(-0.25)
    assert got["ood_change/near"] is None
    # Reward AUC per stage = mean reward over its steps: 0.3, 0.5, 0.2; mean 1.0 / 3.
    assert got["reward_auc/math"] == pytest.approx(0.3)
    assert got["reward_auc/code"] == pytest.approx(0.2)
    assert got["reward_auc"] == pytest.approx(1.0 / 3)
    assert (got["spectral_shift"], got["max_angle_deg"], got["response_cosine"]) == (0.004, 2.5, 0.93)


def test_ood_change_per_domain_by_hand(tmp_path, make_run):
    # math's near set falls 0.75 -> 0.25 while tooluse's rises 0.25 -> 0.75: the average over the
    # domains reads 0, each domain's own metric keeps its drop or gain.
    items = {
        "base": {"math/id": [0, 1], "math/ood_near": [1, 1, 1, 0], "tooluse/ood_near": [1, 0, 0, 0]},
        "math": {"math/id": [1, 1], "math/ood_near": [1, 0, 0, 0], "tooluse/ood_near": [1, 1, 1, 0]},
    }
    got = M.run_metrics(M.RunView(make_run(tmp_path / "run", items)))
    assert got["ood_change/near"] == pytest.approx(0.0)
    assert got["ood_change/math/near"] == pytest.approx(-0.5)
    assert got["ood_change/tooluse/near"] == pytest.approx(0.5)
    assert got["ood_change/math/far"] is None and got["ood_change/science/near"] is None


def test_forgetting_noise_floor_by_hand(view):
    # math: trained at row 1, accuracies .75, .5, .5 from there: p = 1.75 / 3, binomial SE on
    # n = 4 items sqrt(p (1 - p) / 4) = 0.246503; the max runs over m = 2 rows (math, tooluse):
    # E[max of 2 standard normals] = 1 / sqrt(pi) -> 0.246503 * 0.564190 = 0.139074.
    # tooluse: the max runs over one row (m = 1): floor 0. Mean over the two domains.
    p = 1.75 / 3
    want = (math.sqrt(p * (1 - p) / 4) / math.sqrt(math.pi) + 0.0) / 2
    assert M.forgetting_noise_floor(view) == pytest.approx(want, rel=1e-6)
    assert view.item_counts["math/id"] == 4


def test_expected_max_of_normals():
    # E[max of 2] = 1/sqrt(pi); E[max of 3] = 3 / (2 sqrt(pi)); E[max of 1] = 0.
    assert M.expected_max_normal(1) == 0.0
    assert M.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-7)
    assert M.expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-7)


def test_item_scores_group_the_answers_of_one_item(tmp_path, make_run):
    root = make_run(tmp_path / "r", {"base": {"math/id": [1, 0]}})
    samples = {
        "math/id": [
            {"id": "a", "score": 1.0},
            {"id": "a", "score": 0.0},
            {"id": "b", "score": 1.0},
            {"id": "b", "score": 1.0},
            {"id": "c", "score": 0.5},
            {"id": "c", "score": 0.0},
        ]
    }
    (root / "eval_samples" / "base.json").write_text(json.dumps(samples))
    items = M.RunView(root).item_scores["base"]["math/id"]
    # avg@2 per item; a partial score (0.5) is not a correct answer.
    assert items.tolist() == [0.5, 1.0, 0.0]


def test_resampled_matrix(view):
    same = M.resampled_matrix(view, {c: np.arange(4) for c in view.matrix.columns})
    for row in view.matrix.rows:
        assert same.values[row] == pytest.approx(view.matrix.values[row])
    # Item 0 four times: math/id row values 0, 1, 1, 1 (item 0 of each row).
    first = M.resampled_matrix(view, {"math/id": np.zeros(4, dtype=int)})
    assert [first.values[r]["math/id"] for r in first.rows] == [0.0, 1.0, 1.0, 1.0]
    assert first.values["code"]["code/id"] == 0.5  # a column not drawn keeps its value
    assert M.run_metrics(view.with_matrix(first))["backward_transfer/math"] == 0.0


def test_register_rejects_an_unknown_finding_and_a_duplicate():
    with pytest.raises(ValueError, match="unknown finding"):
        M.register(M.Metric("x", "nope", lambda v: 0.0, False, ""))
    with pytest.raises(ValueError, match="already registered"):
        M.register(M.Metric("forgetting", "forgetting", lambda v: 0.0, False, ""))


def test_artifact_metrics_by_hand(tmp_path, make_run):
    root = make_run(tmp_path / "r", {"base": {"math/id": [1, 0]}})
    # A math stage of ten steps where the repeated-box share rises from 0.1 to 0.4 (its first and
    # last 20% are two steps each: head (0.1 + 0.1) / 2, tail (0.4 + 0.4) / 2, gain 0.3; one step
    # lacks the key and counts in neither mean), then a tool-use stage of five steps with no box
    # at all, which has no artifact to amplify and stays out of the gain; max 0.4.
    rates = [0.1, 0.1, 0.2, 0.2, 0.3, None, 0.3, 0.35, 0.4, 0.4]
    with (root / "metrics.jsonl").open("a") as f:
        for stage, values in ((0, rates), (1, [0.0] * 5)):
            for step, r in enumerate(values, start=1):
                rec = {
                    "stage": stage,
                    "stage_domain": "math",
                    "step": step,
                    "artifacts/repeated_ngram_rate": 0.05 * step,
                }
                if r is not None:
                    rec["artifacts/fmt_boxed_repeat_rate"] = r
                if stage == 0 and step in (2, 5):  # teacher-signal steps with repeated-box tokens
                    rec["teacher/artifact_endorsement"] = {2: 0.3, 5: -0.1}[step]
                f.write(json.dumps(rec) + "\n")
    got = M.run_metrics(M.RunView(root))
    assert got["boxed_repeat_max"] == pytest.approx(0.4)
    assert got["boxed_repeat_gain"] == pytest.approx(0.3)
    # Over the whole run's last 20% (3 of 15 steps: tool-use steps 3, 4, 5).
    assert got["repeated_ngram_late"] == pytest.approx((0.15 + 0.2 + 0.25) / 3)
    assert got["teacher_artifact_endorsement"] == pytest.approx((0.3 - 0.1) / 2)


def test_an_artifact_that_never_occurs_gained_nothing(tmp_path, make_run):
    """A run whose repeated-box share is 0 at every step has gain 0, not "missing": dropping it
    would leave only the runs that had the artifact in an arm's mean (GRPO's clean runs)."""
    clean = make_run(tmp_path / "clean", {"base": {"math/id": [1, 0]}})
    none = make_run(tmp_path / "none", {"base": {"math/id": [1, 0]}})
    with (clean / "metrics.jsonl").open("a") as f:
        for step in range(1, 9):
            f.write(
                json.dumps({"stage": 0, "stage_domain": "math", "step": step, "artifacts/fmt_boxed_repeat_rate": 0.0})
                + "\n"
            )
    assert M.run_metrics(M.RunView(clean))["boxed_repeat_gain"] == 0.0
    assert M.run_metrics(M.RunView(none))["boxed_repeat_gain"] is None  # never measured: unknown


def test_reward_change_by_hand(tmp_path, make_run):
    """Last 3 steps' mean reward minus the first 3's, per stage, mean over stages of >= 6 steps:
    math (0.2, 0.4, 0.6, 0.8, 0.5, 0.3, 0.1, 0.1) rises then falls, 0.5/3 - 1.2/3 = -0.7/3; tool use
    (0.1 ... 0.6) rises, 1.5/3 - 0.6/3 = 0.3; a 5-step code stage is too short to count."""
    root = make_run(
        tmp_path / "r",
        {"base": {"math/id": [1, 0]}},
        rewards=[
            (0, "math", [0.2, 0.4, 0.6, 0.8, 0.5, 0.3, 0.1, 0.1]),
            (1, "tooluse", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
            (2, "code", [0.9, 0.0, 0.0, 0.0, 0.0]),
        ],
    )
    got = M.run_metrics(M.RunView(root))["reward_change"]
    assert got == pytest.approx((-0.7 / 3 + 0.3) / 2)


def test_mid_stage_gain_by_hand(tmp_path, make_run):
    items = {
        "base": {"math/id": [0, 0, 1, 0], "tooluse/id": [0, 0, 0, 0]},
        "math": {"math/id": [1, 1, 1, 0], "tooluse/id": [0, 0, 0, 0]},
        "tooluse": {"math/id": [1, 1, 0, 0], "tooluse/id": [1, 0, 0, 0]},
    }
    root = make_run(tmp_path / "r", items)
    # math (stage 0): evals at steps 2 and 4 -> the first, 0.5, minus the base's 0.25; tooluse
    # (stage 1) has none and stays out of the mean.
    with (root / "metrics.jsonl").open("a") as f:
        for stage, step, acc in ((0, 4, 0.75), (0, 2, 0.5), (1, 2, None)):
            rec = {"stage": stage, "step": step, "stage_domain": "math" if stage == 0 else "tooluse"}
            if acc is not None:
                rec["eval/math/id"] = acc
            f.write(json.dumps(rec) + "\n")
    got = M.run_metrics(M.RunView(root))
    assert got["mid_stage_gain/math"] == pytest.approx(0.25)
    assert got["mid_stage_gain/tooluse"] is None
    assert got["mid_stage_gain"] == pytest.approx(0.25)


def test_ood_change_by_mmd_terciles_by_hand(tmp_path, make_run):
    items = {
        "base": {"math/id": [0, 1], "math/ood_near": [0, 0], "math/ood_far": [1, 1], "code/ood_mid": [1, 0]},
        "math": {"math/id": [1, 1], "math/ood_near": [1, 0], "math/ood_far": [0, 1], "code/ood_mid": [0, 0]},
    }
    root = make_run(tmp_path / "r", items)
    got = M.run_metrics(M.RunView(root))
    assert got["ood_mmd/mid"] is None  # no ood_distance.json: not measured
    # Distances from the math stage's training set: near set 0.1, code's mid set 0.5, far 0.9;
    # one pair per tercile, in-stage changes +0.5, -0.5, -0.5.
    (root / "ood_distance.json").write_text(
        json.dumps({"distances": {"math": {"math/ood_near": 0.1, "code/ood_mid": 0.5, "math/ood_far": 0.9}}})
    )
    got = M.run_metrics(M.RunView(root))
    assert (got["ood_mmd/near"], got["ood_mmd/mid"], got["ood_mmd/far"]) == pytest.approx((0.5, -0.5, -0.5))
