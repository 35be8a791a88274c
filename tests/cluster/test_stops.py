"""slurm/continual_4b.sh on a real two-node Slurm, stopped every way a cluster stops a job: the
time-limit USR1 (save, requeue, resume), scancel (save, stay cancelled, resubmit), preemption
(save, requeue) and a node's processes killed (the job ends, a resubmission resumes). Each run
must equal an uninterrupted one (eval matrix and every step's reward), and no process of a job
may outlive it. The job: the smallest that spans two hosts (one HF rank a node, `--nodes=2`)."""

import subprocess
import time
from pathlib import Path

import pytest

from jobs import (
    TINY_HF,
    job,
    job_env,
    log_of,
    no_job_processes,
    node_processes,
    records,
    rewards,
    sbatch,
    submit_dir,
    wait_for,
    wait_state,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = "continual_4b.sh"
LEAD_S = 600  # its #SBATCH --signal=B:USR1@600
KILL_WAIT_S = 60  # tools/cluster.sh's KillWait: scancel's TERM to SIGKILL
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def _submit(cluster, sub: Path, *extra: str) -> tuple[int, dict, Path]:
    env = job_env(cluster, sub, GPUS_PER_NODE="1", RUN_DIR=str(sub / "run"))
    job_id = sbatch(SCRIPT, sub, env, *TINY_HF, *extra, sbatch_args=("--nodes=2",))
    return job_id, env, log_of(sub, SCRIPT, job_id)


def _finished(job_id: int, env: dict, log: Path, restarts: int = 0) -> str:
    info = wait_state(job_id, env, ENDED, timeout=900, log=log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == str(restarts), (info, text[-4000:])
    no_job_processes()
    return text


def _mid_step(sub: Path, seconds: float = 8) -> None:
    """Wait for the first completed step, then hold the next rollout `seconds` long; return once
    a rank is in it. The flag goes at once: the requeued or resubmitted job is not slowed."""
    wait_for("first step", lambda: len(records(sub / "run")) >= 1, timeout=600)
    flag = sub / "slow"
    flag.write_text(str(seconds))
    wait_for("a slowed rollout", Path(f"{flag}.in_rollout").exists, timeout=120, poll=0.05)
    flag.unlink()


def _latest(run: Path) -> str | None:
    path = run / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else None


def _same_as(run: Path, uninterrupted: Path) -> None:
    assert (run / "eval_matrix.csv").read_text() == (uninterrupted / "eval_matrix.csv").read_text()
    assert rewards(run) == rewards(uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    sub = submit_dir(tmp_path_factory.mktemp("uninterrupted"))
    job_id, env, log = _submit(slurm_cluster, sub)
    text = _finished(job_id, env, log)
    return sub / "run", text


def test_the_two_host_job_runs_and_each_rank_picks_the_bridge_interface(uninterrupted):
    run, text = uninterrupted
    assert (run / "report.md").is_file() and (run / "eval_matrix.csv").is_file()
    # The preflight's choice on node 0 and each node's rank: the veth, never loopback.
    assert "network: NCCL_SOCKET_IFNAME=sdpo0 (route to sdpo-node1" in text, text[-3000:]
    for rank in (0, 1):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"[node of rank {rank}]"))
        assert "NCCL_SOCKET_IFNAME=sdpo0" in line and "GLOO_SOCKET_IFNAME=sdpo0" in line, line
    assert "from 10.231.0.12" in text  # rank 1 on the second host's address


def test_time_limit_signal_saves_the_step_requeues_and_resumes(slurm_cluster, uninterrupted, tmp_path):
    sub = submit_dir(tmp_path)
    job_id, env, log = _submit(slurm_cluster, sub)
    _mid_step(sub)
    run = sub / "run"
    before, t0 = _latest(run), time.monotonic()
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job_id)], env=env, check=True, timeout=30)
    # The step in flight finishes (the lead allows it) and is saved, within the lead.
    saved = wait_for(
        "the stop's checkpoint",
        lambda: _latest(run) not in (None, before) and (run / "checkpoints" / str(_latest(run)) / "COMPLETE").is_file(),
        timeout=LEAD_S,
    )
    done = records(run)
    assert _latest(run) in (f"step_{done[-1]['stage']}_{done[-1]['step']:06d}", "stage_1_math"), (
        _latest(run),
        done[-1],
    )
    text = _finished(job_id, env, log, restarts=1)
    assert "stopped by SIGTERM" in text and f"requeueing job {job_id}" in text, text[-4000:]
    assert "resumed from" in text
    _same_as(sub / "run", uninterrupted[0])
    print(
        f"USR1 -> checkpoint {saved:.1f} s after the signal (lead {LEAD_S} s); requeued and resumed "
        f"{time.monotonic() - t0:.0f} s after it"
    )


def test_scancel_saves_and_stays_cancelled_and_a_resubmission_resumes(slurm_cluster, uninterrupted, tmp_path):
    sub = submit_dir(tmp_path)
    job_id, env, log = _submit(slurm_cluster, sub)
    _mid_step(sub)
    t0 = time.monotonic()
    subprocess.run(["scancel", str(job_id)], env=env, check=True, timeout=30)
    info = wait_state(job_id, env, ENDED, timeout=KILL_WAIT_S + 30, log=log)
    no_job_processes(timeout=KILL_WAIT_S + 10)
    took = time.monotonic() - t0
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    latest = _latest(sub / "run")
    assert latest and (sub / "run" / "checkpoints" / latest / "COMPLETE").is_file(), log.read_text()[-4000:]
    assert "stopped by SIGTERM" in log.read_text()
    time.sleep(5)
    assert job(job_id, env)["JobState"] == "CANCELLED"  # not requeued
    again, env2, log2 = _submit(slurm_cluster, sub)
    text = _finished(again, env2, log2)
    assert f"resumed from {latest}" in text, text[-3000:]
    _same_as(sub / "run", uninterrupted[0])
    print(f"scancel -> saved ({latest}) and every process ended {took:.1f} s after it (KillWait {KILL_WAIT_S} s)")


def test_preemption_saves_and_requeues(slurm_cluster, uninterrupted, tmp_path):
    sub = submit_dir(tmp_path)
    job_id, env, log = _submit(slurm_cluster, sub)
    _mid_step(sub)
    urgent = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "urgent",
            "-N2",
            "--exclusive",
            "-o",
            str(sub / "urgent.out"),
            "--wrap",
            "sleep 1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=sub,
    )
    assert urgent.returncode == 0, urgent.stderr
    text = _finished(job_id, env, log, restarts=1)
    assert f"job {job_id} was preempted" in text and "stopped by SIGTERM" in text and "resumed from" in text, text[
        -4000:
    ]
    assert job(int(urgent.stdout.strip()), env)["JobState"] == "COMPLETED"
    _same_as(sub / "run", uninterrupted[0])


def test_a_nodes_processes_killed_mid_step_end_the_job_and_a_resubmission_resumes(
    slurm_cluster, uninterrupted, tmp_path
):
    sub = submit_dir(tmp_path)
    job_id, env, log = _submit(slurm_cluster, sub, "checkpoint.save_every=1")
    _mid_step(sub, seconds=20)
    t0 = time.monotonic()
    # Every process of the job on the second node (its torchrun, rank and their helpers), as an
    # OOM kill or a crash takes them; the node's Slurm daemons (slurmd, slurmstepd) stay.
    victims = [p.split()[0] for p in node_processes()["sdpo-node2"] if "slurmstepd" not in p]
    assert victims, "no job process on the second node"
    subprocess.run(["kill", "-KILL", *victims], check=False)
    info = wait_state(job_id, env, ENDED, timeout=120, log=log)
    no_job_processes(timeout=60)
    took = time.monotonic() - t0
    assert info["JobState"] in {"FAILED", "CANCELLED"}, info
    latest = _latest(sub / "run")
    assert latest is not None
    again, env2, log2 = _submit(slurm_cluster, sub, "checkpoint.save_every=1")
    text = _finished(again, env2, log2)
    assert f"resumed from {latest}" in text, text[-3000:]
    _same_as(sub / "run", uninterrupted[0])
    print(f"node 2's processes killed -> job {info['JobState']} and every process ended {took:.1f} s after")
