"""The safeguard study's secondary endpoints on hand-built runs: the per-step means and sums,
the right-operation share the export writes, and the table's paired columns against GRPO."""

import json

import pytest

from megatron_sdpo.config import dump_yaml, load_config
from megatron_sdpo.evaluation import load_eval_sets
from megatron_sdpo.outputs.run_dir import RunDir
from megatron_sdpo.study import operations, results
from megatron_sdpo.study import preregistered as pr
from megatron_sdpo.study import secondary as S


def test_step_values_by_hand(tmp_path):
    rows = [
        {"step": 1, S.KL: 0.2, S.GATE: 1.0, S.AGREE: 0.5, "time/rollout": 10.0, "time/teacher": 2.0, "time/train": 3.0},
        {"step": 2, S.GATE: 0.5, S.AGREE: 0.7, "time/rollout": 11.0, "time/teacher": 1.0, "time/train": 4.0},
        {"step": 3, S.KL: 0.4, S.GATE: 0.0, "time/rollout": 9.0, "time/sync": 100.0},  # sync is not compute
    ]
    (tmp_path / S.OPERATIONS_JSON).write_text(
        json.dumps(
            {
                "rows": [
                    {"row": 0, "split": "ood_near", "right": 0.6},
                    {"row": 1, "split": "ood_near", "right": 0.4},
                    {"row": 1, "split": "ood_far", "right": 0.9},
                ]
            }
        )
    )
    v = S.step_values(rows, tmp_path)
    assert v[S.KL] == pytest.approx(0.3) and v[S.GATE] == pytest.approx(0.5) and v[S.AGREE] == pytest.approx(0.6)
    assert v["compute_s"] == pytest.approx(40.0) and v["right_op/near"] == 0.4  # the last eval row
    grpo = S.step_values([{"step": 1, "time/rollout": 5.0}], tmp_path / "none")
    assert grpo[S.KL] is None and grpo[S.GATE] is None and grpo["right_op/near"] is None and grpo["compute_s"] == 5.0


def test_the_table_pairs_each_arm_with_grpo():
    runs = []
    for seed, (e_sdpo, g_sdpo) in enumerate([(-0.1, 0.1), (-0.3, 0.2), (-0.2, 0.15)]):
        runs.append(("grpo", seed, {pr.NEAR: 0.1, pr.FAR: 0.1, pr.GAIN: 0.2, "compute_s": 100.0}))
        runs.append(
            (
                "sdpo_frozen",
                seed,
                {
                    pr.NEAR: e_sdpo,
                    pr.FAR: e_sdpo,
                    pr.GAIN: g_sdpo,
                    S.KL: 0.01 * (seed + 1),
                    "right_op/near": 0.5,
                    "spectral_shift": 0.002,
                    "compute_s": 130.0,
                },
            )
        )
    lines = S.table(runs)
    grpo, sdpo = lines[2].split(" | "), lines[3].split(" | ")
    assert grpo[:4] == ["| `grpo`", "3", "–", "–"] and grpo[-1] == "100 |"
    # E − E(GRPO): −0.2, −0.4, −0.3: mean −0.3, sd 0.1, t_{0.975,2} = 4.3027: ± 0.248.
    assert sdpo[2] == "-0.300 [-0.548, -0.052]"
    assert sdpo[3] == "-0.050 [-0.174, +0.074]"  # gains −0.1, 0, −0.05
    assert sdpo[4:8] == ["0.500", "0.002", "–", "0.0200"] and sdpo[-1] == "130 |"


def test_the_export_writes_the_right_operation_shares(tmp_path):
    run = tmp_path / "study" / "runs" / "grpo" / "seed0"
    rd = RunDir(run)
    rd.eval_samples.mkdir(parents=True)
    cfg = load_config("tiny", ["seed=0"])
    rd.config.write_text(dump_yaml(cfg))
    recs = load_eval_sets(cfg)["math/ood_near"]
    answers = [{"id": r["id"], "response": "2 + 2 = 4", "score": 0.0} for r in recs]  # always adds
    (rd.eval_samples / "base.json").write_text(json.dumps({"math/ood_near": answers}))
    rd.write_eval_matrix([("base", {"math/ood_near": 0.0})])
    rd.report.write_text("# done\n")
    dest = results.export(tmp_path / "study", tmp_path / "out", command="x", commit="abc")
    rows = json.loads((dest / "runs" / "grpo" / "seed0" / S.OPERATIONS_JSON).read_text())["rows"]
    plus = sum(operations.first_operation(r["solution"]) == "+" for r in recs) / len(recs)
    assert [(r["row"], r["split"], r["plus"], r["n"]) for r in rows] == [(0, "ood_near", 1.0, len(recs))]
    assert rows[0]["right"] == pytest.approx(plus)
    assert S.step_values([], dest / "runs" / "grpo" / "seed0")["right_op/near"] == pytest.approx(plus)
