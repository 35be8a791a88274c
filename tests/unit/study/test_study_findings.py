"""study.csv / study.md from fake runs whose differences are the hand-computed case of
test_study_stats.py: the statistics and verdicts flow through to the tables unchanged."""

import csv

import pytest

from megatron_sdpo.study.findings import compare_arms, load_runs, write_csv, write_markdown

# Per seed, sdpo_frozen - grpo on math after the math stage (10 items): 0.1, 0.2, 0.3, 0.0, 0.2, 0.4.
CASE = [1, 2, 3, 0, 2, 4]  # items


def _items(correct: int, n: int = 10) -> list[int]:
    return [1] * correct + [0] * (n - correct)


@pytest.fixture
def six_seeds(tmp_path, make_run):
    entries = []
    for seed, extra in enumerate(CASE):
        base = {"math/id": _items(2)}
        for arm, correct in (("grpo", 3), ("sdpo_frozen", 3 + extra)):
            root = make_run(
                tmp_path / arm / f"seed{seed}",
                {"base": base, "math": {"math/id": _items(correct)}},
                [(0, "math", [0.1 * correct])],
            )
            entries.append((arm, seed, root))
    return entries


def _by_name(comparisons, name):
    (c,) = [c for c in comparisons if c.metric.name == name]
    return c


def test_verdicts_flow_from_the_hand_case(six_seeds, tmp_path):
    runs = load_runs(six_seeds, {"grpo/seed0": 12.0})
    assert len(runs) == 12 and runs[0].wall_s == 12.0
    comps = compare_arms(runs, "grpo", ["grpo", "sdpo_frozen"], n_boot=200)
    gain = _by_name(comps, "in_stage_gain/math")
    # The hand case: mean 0.2, t-interval 0.2 -+ 0.148413, 5 of 6 seeds positive.
    assert gain.summary.mean == pytest.approx(0.2)
    assert (gain.summary.lo, gain.summary.hi) == (pytest.approx(0.051587, abs=1e-6), pytest.approx(0.348413, abs=1e-6))
    # The paper: SDPO gains more in the MATH stage (+73% vs +38%); the finding's primary, at 95%.
    assert gain.judgement.primary and gain.judgement.level == pytest.approx(0.95)
    assert gain.verdict == "established"
    assert gain.arm_mean == pytest.approx(0.3) and gain.base_mean == pytest.approx(0.1)
    # The same differences on the final accuracy, where the paper says SDPO ends lower.
    assert _by_name(comps, "final_avg_id").verdict == "contradicted"
    # The mean over stages and the reward AUC: the paper states no number for them.
    assert _by_name(comps, "in_stage_gain").verdict == _by_name(comps, "reward_auc").verdict == "descriptive"
    # Against another baseline than the paper's, no metric has a paper direction.
    others = compare_arms(runs, "sdpo_frozen", ["grpo", "sdpo_frozen"], n_boot=0)
    assert {c.verdict for c in others} == {"descriptive"}
    # No later stage: nothing to forget, no metric.
    assert _by_name(comps, "forgetting").summary is None

    write_csv(tmp_path / "study.csv", runs)
    rows = list(csv.DictReader((tmp_path / "study.csv").open()))
    assert [(r["arm"], r["seed"]) for r in rows[:2]] == [("grpo", "0"), ("sdpo_frozen", "0")]
    assert float(rows[1]["in_stage_gain"]) == pytest.approx(0.2) and rows[0]["wall_s"] == "12"
    md = write_markdown(
        tmp_path / "study.md",
        title="T",
        arms={"grpo": "a", "sdpo_frozen": "b"},
        runs=runs,
        planned=12,
        baseline="grpo",
        comparisons=comps,
        n_boot=200,
        pilot_detect=0.05,
    ).read_text()
    line = next(x for x in md.splitlines() if x.startswith("| `in_stage_gain/math` |"))
    assert "[0.052, 0.348] (95%)" in line and "5/6" in line and "*established*" in line and "| primary |" in line
    assert "*contradicted*" in next(x for x in md.splitlines() if x.startswith("| `final_avg_id` |"))
    assert "12 of 12 runs finished" in md
    # Pilot: paired SD 0.141421 for the gain, so seeds for 0.05 are those for sd/d = 2.83.
    pilot = next(x for x in md.splitlines() if x.startswith("| in_stage_gain/math | sdpo_frozen"))
    assert "0.141" in pilot


def test_a_grpo_arm_against_grpo_is_described_not_judged(six_seeds):
    """The paper's directions are SDPO's against GRPO: the same differences from an arm whose
    runs trained GRPO (the paper's 4-step recipe) carry no direction and no verdict."""
    for arm, _seed, root in six_seeds:
        algorithm = "grpo" if arm == "grpo" else "sdpo"
        (root / "resolved_config.yaml").write_text(f"algorithm:\n  name: {algorithm}\n")
    sdpo = compare_arms(load_runs(six_seeds, {}), "grpo", ["grpo", "sdpo_frozen"], n_boot=0)
    assert _by_name(sdpo, "in_stage_gain/math").verdict == "established"
    for _arm, _seed, root in six_seeds:
        (root / "resolved_config.yaml").write_text("algorithm:\n  name: grpo\n")
    grpo = compare_arms(load_runs(six_seeds, {}), "grpo", ["grpo", "sdpo_frozen"], n_boot=0)
    assert {c.verdict for c in grpo} == {"descriptive"} and {c.direction for c in grpo} == {None}
    assert _by_name(grpo, "in_stage_gain/math").summary.mean == pytest.approx(0.2)


def test_bootstrap_pairs_the_items_of_a_seed(tmp_path, make_run):
    # One seed, four items per arm (grpo 0,1,0,0, SDPO 1,1,0,0, the same items): the per-item
    # difference is 1,0,0,0 and the bootstrap interval of the final accuracy's difference is
    # [0, 0.75] (test_study_stats.py works it out). Unpaired draws would reach below 0.
    entries = []
    for arm, items in (("grpo", [0, 1, 0, 0]), ("sdpo_frozen", [1, 1, 0, 0])):
        root = make_run(tmp_path / arm, {"base": {"math/id": [0, 0, 0, 0]}, "math": {"math/id": items}})
        entries.append((arm, 0, root))
    comps = compare_arms(load_runs(entries, {}), "grpo", ["grpo", "sdpo_frozen"], n_boot=2000)
    assert _by_name(comps, "final_avg_id").boot == (0.0, 0.75)
    assert _by_name(comps, "final_avg_id").verdict == "inconclusive"  # one seed: no t-interval


def test_unfinished_runs_are_left_out(tmp_path, make_run):
    root = make_run(tmp_path / "a", {"base": {"math/id": [1]}, "math": {"math/id": [1]}})
    (root / "report.md").unlink()
    assert load_runs([("grpo", 0, root)], {}) == []
