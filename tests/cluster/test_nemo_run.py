"""launchers/nemo_run.py --executor slurm on the test cluster: NeMo-Run renders and submits the job
through a LocalTunnel, and it completes across the two hosts with the environment the sbatch
body exports (slurm/cluster.env, the stop lead, the node list)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import REPO, TINY_HF, job, no_job_processes, rewards, wait_state

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LAUNCH_PY = REPO / ".venv-launch" / "bin" / "python"


def _job_ids(env: dict) -> set[int]:
    """Every job the controller knows, finished ones included (MinJobAge keeps them an hour)."""
    out = subprocess.run(["scontrol", "show", "jobs", "-o"], env=env, capture_output=True, text=True, timeout=30).stdout
    return {int(line.split()[0].removeprefix("JobId=")) for line in out.splitlines() if line.startswith("JobId=")}


@pytest.mark.skipif(not LAUNCH_PY.is_file(), reason="the launch environment is missing: make launch-env")
def test_nemo_run_submits_a_two_host_job_that_completes(slurm_cluster, tmp_path):
    env = {
        **os.environ,
        **slurm_cluster,
        "NEMORUN_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    before = _job_ids(env)
    out = subprocess.run(
        [
            str(LAUNCH_PY),
            str(REPO / "launchers" / "nemo_run.py"),
            "qwen3_4b",
            *TINY_HF,
            "--executor",
            "slurm",
            "--account",
            "test",
            "--nodes",
            "2",
            "--nproc-per-node",
            "1",
            "--job-dir",
            str(tmp_path / "jobs"),
            "--packager",
            "none",
            "--out",
            str(tmp_path / "run"),
            "--python",
            sys.executable,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    ids = sorted(_job_ids(env) - before)
    assert len(ids) == 1, ids
    info = wait_state(ids[0], env, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=900)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "jobs").rglob("*.out")))
    assert info["JobState"] == "COMPLETED", logs[-5000:]
    no_job_processes()
    assert job(ids[0], env)["Restarts"] == "0"
    run = tmp_path / "run"
    assert (run / "report.md").is_file() and [(s, k) for s, k, _ in rewards(run)] == [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    # The ranks on the second host chose the veth, from the job's node list.
    node_lines = [ln for ln in logs.splitlines() if "[node of rank 1]" in ln and "(route to " in ln]
    assert node_lines and "NCCL_SOCKET_IFNAME=sdpo0" in node_lines[0] and "from 10.231.0.12" in node_lines[0], logs[
        -3000:
    ]
    rendered = next((tmp_path / "jobs").rglob("*_sbatch.sh")).read_text()
    assert "#SBATCH --signal=TERM@720" in rendered and "export NCCL_NVLS_ENABLE=0" in rendered
