"""The main job end to end on the tiny model: outputs, resume after a kill, compare.

The small run samples dynamically (algorithm.filter_groups, one extra round at most), so the
resumed runs also show that the extra rounds' prompts and seeds follow the position."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_process import cli, kill_when, wait_for

SMALL = """
defaults: tiny
name: e2e
stages:
  - {domain: math, steps: 4}
  - {domain: tooluse, steps: 3}
domains:
  math: {eval: {id: {n: 12}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
  science: {eval: {id: {n: 8}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
  tooluse: {eval: {id: {n: 12}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
  code: {eval: {id: {n: 8}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
algorithm: {prompts_per_step: 6, group_size: 4, filter_groups: {enabled: true, max_extra_rounds: 1}}
rollout: {engine: hf, max_new_tokens: 24}
eval: {max_new_tokens: 24}
checkpoint: {save_every: 2}
diagnostics: {probe_n: 4}
logging: {wandb: true, wandb_mode: offline}
"""


def finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def small_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "small.yaml"
    path.write_text(SMALL)
    return path


@pytest.fixture(scope="module")
def full_run(small_yaml, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("full")
    finish(cli("run", str(small_yaml), "--out", "run", "--quiet", cwd=cwd))
    return cwd / "run"


@pytest.mark.slow
def test_run_writes_every_output(full_run):
    for name in ("resolved_config.yaml", "metrics.jsonl", "eval_matrix.csv", "report.md"):
        assert (full_run / name).is_file(), name
    rows = list(csv.reader((full_run / "eval_matrix.csv").open()))
    assert rows[0][0] == "after_stage" and "math/id" in rows[0] and "code/ood_far" in rows[0]
    assert [r[0] for r in rows[1:]] == ["base", "math", "tooluse"]
    assert all(0.0 <= float(v) <= 1.0 for r in rows[1:] for v in r[1:])
    metrics = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["stage"], m["step"]) for m in metrics] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3)]
    for m in metrics:
        assert {"stage", "step", "algorithm", "reward_mean", "loss"} <= set(m)
    for png in ("eval_matrix.png", "reward_curves.png"):
        assert (full_run / "plots" / png).stat().st_size > 1000
    drift = json.loads((full_run / "drift" / "stage_2.json").read_text())
    assert drift["param_vs_base"]["summary"]["rel_frob_pooled"] > 0
    assert (full_run / "checkpoints" / "stage_1_math" / "policy" / "config.json").is_file()
    assert any((full_run / "wandb").glob("offline-run-*")), "wandb offline run directory missing"
    report = (full_run / "report.md").read_text()
    assert "Forgetting" in report and "Drift after each stage" in report
    assert "Where the wall time went" in report


@pytest.mark.slow
def test_the_run_says_where_its_wall_time_went(full_run):
    t = json.loads((full_run / "timings.json").read_text())
    phases = t["phases"]
    # Every phase outside the steps has its name: start-up per engine, each eval split, each
    # save, each diagnostic; together with `other` they are the run's wall time.
    want = {"start/imports_and_config", "start/backend", "start/engine", "start/refit", "steps", "save/step"}
    want |= {"save/stage", "stage/start", "diagnostics/stage_probes", "diagnostics/drift_jobs_wait"}
    want |= {f"eval/{d}/{s}" for d in ("math", "code") for s in ("id", "ood_far")}
    assert want <= set(phases), sorted(want - set(phases))
    assert all(v >= 0 for v in phases.values()) and t["other_s"] >= 0
    assert sum(phases.values()) + t["other_s"] == pytest.approx(t["wall_s"], rel=1e-9)
    metrics = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    # The steps' phase holds the steps: at least what they measured themselves.
    assert phases["steps"] >= sum(m["time/step"] for m in metrics)


@pytest.mark.slow
def test_killed_and_resumed_run_matches_uninterrupted(full_run, small_yaml, tmp_path):
    proc = cli("run", str(small_yaml), "--out", "run", "--quiet", cwd=tmp_path, start_new_session=True)
    # Killed mid-stage 2, with no chance to clean up.
    kill_when(proc, tmp_path / "run" / "checkpoints" / "step_1_000002" / "COMPLETE", "a mid-stage checkpoint")
    proc.wait()
    assert not (tmp_path / "run" / "report.md").exists()
    resume_matches_uninterrupted(full_run, small_yaml, tmp_path, "step_1_000002")


def wait_for_stage_2(proc, tmp_path):
    """Wait until the run in tmp_path/run has logged a step of stage 2; its metrics.jsonl."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(proc, lambda: metrics.exists() and '"stage": 1' in metrics.read_text(), "stage 2's first step")
    return metrics


def resume_matches_uninterrupted(full_run, small_yaml, tmp_path, latest):
    """Resume the stopped run in tmp_path/run from `latest`: its eval matrix, rewards and losses
    are the uninterrupted run's; returns both runs' metrics records."""
    out = finish(cli("run", str(small_yaml), "--out", "run", "--resume", "--quiet", cwd=tmp_path))
    assert f"resumed from {latest}" in out
    assert (tmp_path / "run" / "eval_matrix.csv").read_text() == (full_run / "eval_matrix.csv").read_text()
    ours = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(x) for x in (full_run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["stage"], m["step"], m["reward_mean"]) for m in ours] == [
        (m["stage"], m["step"], m["reward_mean"]) for m in theirs
    ]
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in theirs], abs=1e-6)
    return ours, theirs


@pytest.mark.slow
def test_sigterm_saves_the_last_step_and_resume_matches_uninterrupted(full_run, small_yaml, tmp_path):
    proc = cli("run", str(small_yaml), "--out", "run", "--quiet", cwd=tmp_path)
    metrics = wait_for_stage_2(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)  # mid-stage 2, as Slurm or torchrun would
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out and "Traceback" not in out
    done = [json.loads(x) for x in metrics.read_text().splitlines()]
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    # The checkpoint is the last completed step's, not the last periodic one.
    assert latest == f"step_1_{done[-1]['step']:06d}" and done[-1]["stage"] == 1, (latest, done[-1])
    assert (tmp_path / "run" / "checkpoints" / latest / "COMPLETE").is_file()
    ours, theirs = resume_matches_uninterrupted(full_run, small_yaml, tmp_path, latest)
    # The resumed stage drew the same extra rounds; some step needed one.
    dyn = ("dynamic/rounds", "dynamic/extra_rollouts", "dynamic/kept_groups", "train/rows_skipped")
    assert [[m.get(k) for k in dyn] for m in ours] == [[m.get(k) for k in dyn] for m in theirs]
    assert any(m["dynamic/rounds"] > 1 for m in theirs)


COMPARE = """
defaults: tiny
name: cmp
stages:
  - {domain: math, steps: 2}
  - {domain: science, steps: 2}
domains:
  math: {eval: {id: {n: 8}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
  science: {eval: {id: {n: 8}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
  tooluse: {eval: {id: {n: 4}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
  code: {eval: {id: {n: 4}, ood_near: {n: 4}, ood_mid: {n: 4}, ood_far: {n: 4}}}
algorithm: {prompts_per_step: 4, group_size: 4}
rollout: {engine: hf, max_new_tokens: 16}
eval: {max_new_tokens: 16}
checkpoint: {save_every: 0}
diagnostics: {probe_n: 2}
"""


@pytest.mark.slow
def test_compare_puts_algorithms_side_by_side(tmp_path):
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text(COMPARE)
    out = finish(cli("compare", str(cfg), "--algorithms", "grpo,sdpo", "--out", "cmp", "--quiet", cwd=tmp_path))
    assert "compare directory" in out
    text = (tmp_path / "cmp" / "compare.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| grpo") or line.startswith("| sdpo")]
    assert len(table) >= 2, text
    assert "Drift:" in text and "Training and artifacts:" in text
    for algo in ("grpo", "sdpo"):
        resolved = (tmp_path / "cmp" / algo / "resolved_config.yaml").read_text()
        assert f"name: {algo}" in resolved
    assert (tmp_path / "cmp" / "plots" / "compare.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
def test_megatron_backend_runs_the_continual_job_like_the_hf_backend(small_yaml, tmp_path):
    """The same loop through megatron-core (CPU shim) with colocated in-process vLLM: SDPO with the
    teacher scored in the student's schedule, weights streamed from megatron's export into vLLM
    after every step, a cosine LR restarted per stage. Step for step it matches the HF backend."""
    common = [
        "algorithm=sdpo",
        "rollout.engine=vllm",
        "stages.0.steps=2",
        "stages.1.steps=2",
        "backend.lr_schedule.style=cosine",
        "backend.lr_schedule.min_lr_ratio=0.5",
    ]
    procs = {
        b: cli("run", str(small_yaml), *common, f"backend={b}", "--out", b, "--quiet", cwd=tmp_path)
        for b in ("megatron", "hf")
    }
    for proc in procs.values():
        finish(proc, timeout=1500)
    run = tmp_path / "megatron"
    rows = list(csv.reader((run / "eval_matrix.csv").open()))
    assert [r[0] for r in rows[1:]] == ["base", "math", "tooluse"]
    assert rows == list(csv.reader((tmp_path / "hf" / "eval_matrix.csv").open()))
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["stage"], m["step"], m["algorithm"]) for m in steps] == [
        (0, 1, "sdpo"),
        (0, 2, "sdpo"),
        (1, 1, "sdpo"),
        (1, 2, "sdpo"),
    ]
    # Each stage restarts the cosine: the peak, then halfway down to 0.5 x peak.
    assert [m["lr"] for m in steps] == pytest.approx([1e-4, 7.5e-5, 1e-4, 7.5e-5])
    # Same rollouts (vLLM got the same weights), same losses and gradient norms.
    assert [m["reward_mean"] for m in steps] == [m["reward_mean"] for m in ref]
    for m, r in zip(steps, ref, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-3)
        assert m["sdpo/loss_per_token"] > 0
    assert (run / "checkpoints" / "stage_2_tooluse" / "COMPLETE").is_file()
    assert "name: megatron" in (run / "resolved_config.yaml").read_text()


@pytest.mark.slow
def test_a_stage_of_zero_steps_keeps_its_model_and_gets_a_row(small_yaml, tmp_path):
    # Its eval row and diagnostics describe the model it started from (they once failed on the
    # stage's missing checkpoint).
    finish(cli("run", str(small_yaml), "stages.0.steps=2", "stages.1.steps=0", "--out", "run", "--quiet", cwd=tmp_path))
    run = tmp_path / "run"
    rows = list(csv.reader((run / "eval_matrix.csv").open()))
    assert [r[0] for r in rows[1:]] == ["base", "math", "tooluse"]
    assert rows[2][1:] == rows[3][1:]  # greedy eval of the same weights
    assert (run / "checkpoints" / "stage_2_tooluse" / "COMPLETE").is_file()
    assert (run / "drift" / "stage_2.json").is_file()


SLOW_ROLLOUT = """
import pathlib, sys, time
from megatron_sdpo import trainer
_rollout = trainer.Trainer._rollout
def _slow(self, *args, **kwargs):
    flag = pathlib.Path("slow")
    if flag.exists():  # the test's injected delay: a step longer than the job's lead allows
        pathlib.Path("in_rollout").touch()
        time.sleep(float(flag.read_text()))
    return _rollout(self, *args, **kwargs)
trainer.Trainer._rollout = _slow
from megatron_sdpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("lead, reserve, abandoned", [(30, 40, True), (600, 10, False)])
def test_a_stop_mid_step_saves_the_last_step_the_lead_allows(full_run, small_yaml, tmp_path, lead, reserve, abandoned):
    """The time-limit signal arrives in a slowed rollout. With a lead the step cannot fit (the
    rest of the step plus the save's reserve exceed it) the step is abandoned before its
    optimizer step and the last completed step is saved, well within the lead; a resumed run
    equals the uninterrupted one. With a long lead the step finishes and is the checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SDPO_STOP_LEAD_S": str(lead), "SDPO_STOP_RESERVE_S": str(reserve)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_ROLLOUT, "run", str(small_yaml), "--out", "run", "--quiet"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    metrics = wait_for_stage_2(proc, tmp_path)
    (tmp_path / "slow").write_text("6")
    wait_for(proc, (tmp_path / "in_rollout").exists, "a slowed rollout", poll=0.02)
    before = [json.loads(x) for x in metrics.read_text().splitlines()]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)  # Slurm's time-limit signal, mid-rollout
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGUSR1, out[-3000:]
    assert "stopped by SIGUSR1" in out and "Traceback" not in out
    done = [json.loads(x) for x in metrics.read_text().splitlines()]
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    # The stage's last step (3 of 3) ends at the stage's own checkpoint (the rollout polled the
    # flag before the test saw step 1 logged, so the slowed step may be the last one).
    last = "stage_2_tooluse" if done[-1]["step"] == 3 else f"step_1_{done[-1]['step']:06d}"
    assert latest == last and done[-1]["stage"] == 1, (latest, done[-1])
    assert (tmp_path / "run" / "checkpoints" / latest / "COMPLETE").is_file()
    if not abandoned:
        assert len(done) == len(before) + 1 and "abandoned" not in out  # the slowed step finished
        return
    assert len(done) == len(before), "the abandoned step left a record"
    assert (
        f"stage 2 step {len(before) - before.index(next(m for m in before if m['stage'] == 1)) + 1} abandoned" in out
    ), out[-2000:]
    assert took < lead, f"the stop took {took:.1f} s, more than the {lead} s lead"
    (tmp_path / "slow").unlink()
    resume_matches_uninterrupted(full_run, small_yaml, tmp_path, latest)
