"""Stopping a launched job: SIGTERM to torchrun saves the last completed step on every rank and a
resumed run equals an uninterrupted one; a rank killed outright ends the job, no hang.

Megatron TP=2 with colocated vLLM replicas, as on a cluster node (two gloo ranks here)."""

import json
import os
import signal
import subprocess
import time

import pytest

from cli_process import torchrun_cli, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.megatron, pytest.mark.vllm, pytest.mark.slow]

GRACE_S = 60


def _torchrun(cfg, *args, cwd):
    cmd = torchrun_cli(
        2, "run", str(cfg), "--out", "run", "--quiet", *args, launcher=(f"--shutdown-timeout={GRACE_S}",)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def _finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _records(run):
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, tiny_two_stage):
    path = tmp_path_factory.mktemp("cfg") / "stop.yaml"
    path.write_text(
        tiny_two_stage(
            "stop",
            steps=(3, 4),
            rollout="{engine: vllm, max_new_tokens: 16}",
            eval="{max_new_tokens: 16}",
            backend="{name: megatron, megatron: {tensor_parallel: 2}}",
            checkpoint="{save_every: 0}",
            diagnostics="{probe_n: 2}",
        )
    )
    return path


@pytest.fixture(scope="module")
def uninterrupted(cfg, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("full")
    _finish(_torchrun(cfg, cwd=cwd))
    return cwd / "run"


def test_sigterm_to_torchrun_saves_the_last_step_and_resume_matches(cfg, uninterrupted, tmp_path):
    proc = _torchrun(cfg, cwd=tmp_path)
    run = tmp_path / "run"
    wait_for(proc, lambda: any(r["stage"] == 1 for r in _records(run)), "stage 2's first step")
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as srun delivers it
    out, _ = proc.communicate(timeout=GRACE_S + 30)
    assert time.time() - t0 < 60, "the ranks took over a minute to stop"
    assert proc.returncode != 0 and "stopped by SIGTERM" in out, out[-4000:]
    done = _records(run)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_1_{done[-1]['step']:06d}" and done[-1]["stage"] == 1, (latest, done[-1])
    assert (run / "checkpoints" / latest / "COMPLETE").is_file()
    out = _finish(_torchrun(cfg, "--resume", cwd=tmp_path))
    assert f"resumed from {latest}" in out
    assert (run / "eval_matrix.csv").read_text() == (uninterrupted / "eval_matrix.csv").read_text()
    ours, theirs = _records(run), _records(uninterrupted)
    assert [(m["stage"], m["step"], m["reward_mean"]) for m in ours] == [
        (m["stage"], m["step"], m["reward_mean"]) for m in theirs
    ]


def test_a_rank_killed_outright_ends_the_job(cfg, tmp_path):
    psutil = pytest.importorskip("psutil")
    proc = _torchrun(cfg, cwd=tmp_path)
    wait_for(proc, lambda: bool(_records(tmp_path / "run")), "the first step")
    workers = psutil.Process(proc.pid).children()  # torchrun's ranks
    assert len(workers) >= 2, workers
    t0 = time.time()
    os.kill(workers[-1].pid, signal.SIGKILL)
    proc.communicate(timeout=90)
    assert time.time() - t0 < 60 and proc.returncode != 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers), "a rank outlived the job"
