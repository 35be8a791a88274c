"""`study` end to end on a shortened tiny preset: 2 arms x 2 seeds, killed mid-way and resumed,
then study.csv / study.md with intervals and verdicts, and a pilot's seed count."""

import csv

import pytest

from cli_process import cli, kill_when

ARGS = [
    "study",
    "short.yaml",
    "--arms",
    "grpo,sdpo_frozen",
    "--seeds",
    "0-1",
    "--jobs",
    "2",
    "--threads",
    "2",
    "--out",
    "st",
    "--bootstrap",
    "200",
]


def finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_study_is_resumable_after_a_kill_and_judges_the_findings(tmp_path, tiny_two_stage):
    (tmp_path / "short.yaml").write_text(
        tiny_two_stage(
            "study_e2e",
            rollout="{engine: hf, max_new_tokens: 16}",
            eval="{max_new_tokens: 16, at_steps: [1]}",
            checkpoint="{save_every: 1}",
            diagnostics="{probe_n: 2, response_drift: false}",
        )
    )
    runs = tmp_path / "st" / "runs"
    proc = cli(*ARGS, cwd=tmp_path, start_new_session=True)
    # Runs start seed by seed: the third (grpo, seed 1) starts when a seed-0 run has finished;
    # kill the whole study once it holds a mid-stage checkpoint.
    kill_when(proc, runs / "grpo" / "seed1" / "checkpoints" / "latest", "the third run's checkpoint")
    proc.wait()
    finished = {p.parent.parent.name + "/" + p.parent.name for p in runs.glob("*/*/report.md")}
    assert "grpo/seed1" not in finished and finished & {"grpo/seed0", "sdpo_frozen/seed0"}, finished
    assert not (tmp_path / "st" / "study.md").exists()

    out = finish(cli(*ARGS, cwd=tmp_path))
    for label in finished:
        assert f"[study] {label}: already finished" in out, out[-3000:]
    assert "[study] grpo/seed1: resuming" in out, out[-3000:]
    assert "resumed from" in (tmp_path / "st" / "logs" / "grpo-seed1.log").read_text()

    rows = list(csv.DictReader((tmp_path / "st" / "study.csv").open()))
    assert sorted((r["arm"], r["seed"]) for r in rows) == [
        ("grpo", "0"),
        ("grpo", "1"),
        ("sdpo_frozen", "0"),
        ("sdpo_frozen", "1"),
    ]
    for r in rows:
        assert 0.0 <= float(r["final_avg_id"]) <= 1.0 and r["backward_transfer"] != "" and r["reward_auc"] != ""
        assert r["mid_stage_gain"] != ""  # eval.at_steps: the math and tooluse stages' step-1 evals
    md = (tmp_path / "st" / "study.md").read_text()
    assert "4 of 4 runs finished" in md
    line = next(x for x in md.splitlines() if x.startswith("| `final_avg_id` | primary | sdpo_frozen |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # Two seeds: a t-interval on 1 degree of freedom at 95% (the finding's primary), a bootstrap
    # interval, a sign count of 2.
    assert cells[6].startswith("[") and cells[6].endswith("(95%)") and cells[7].startswith("["), line
    assert cells[8].endswith("/2"), line
    assert cells[11] in ("*established*", "*contradicted*", "*equivalent*", "*inconclusive*"), line

    out = finish(
        cli(
            "study",
            "short.yaml",
            "--arms",
            "grpo,sdpo_frozen",
            "--pilot",
            "2",
            "--detect",
            "0.1",
            "--out",
            "st",
            cwd=tmp_path,
        )
    )
    assert out.count("already finished") == 4
    assert "seeds needed to detect a difference of 0.1" in out
    pilot = [x.split() for x in out.splitlines() if x.startswith("final_avg_id ")]
    assert pilot and all(int(r[-1]) >= 2 for r in pilot), out[-2000:]
