"""`sbatch slurm/continual_7b.sh` as GPU users run it (the megatron backend at TP 2, colocated vLLM
replicas of TP 2, torchrun across two hosts), made a tiny CPU job by overrides and environment
variables only: 2 nodes x 2 ranks over gloo."""
import pytest

from jobs import TINY, job_env, log_of, no_job_processes, rewards, sbatch, submit_dir, wait_state

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.megatron, pytest.mark.vllm]

SCRIPT = "continual_7b.sh"
MEGATRON = ["backend.megatron.tensor_parallel=2", "backend.megatron.params_dtype=float32", "rollout.tensor_parallel_size=2"]


def test_the_7b_script_runs_megatron_and_vllm_across_two_hosts(slurm_cluster, tmp_path):
    sub = submit_dir(tmp_path)
    env = job_env(slurm_cluster, sub, GPUS_PER_NODE="2", RUN_DIR=str(sub / "run"))
    job_id = sbatch(SCRIPT, sub, env, *TINY, *MEGATRON)
    log = log_of(sub, SCRIPT, job_id)
    info = wait_state(job_id, env, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=1500, log=log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-5000:]
    no_job_processes()
    # The preflight on one node planned the job's 4 ranks as the ranks then ran them.
    assert "ranks: 4 (--world-size)" in text and "trainer layout: TP=2 PP=1 DP=2" in text, text[:4000]
    assert "vLLM TP=2 (rollout.tensor_parallel_size), vLLM replicas=2" in text
    assert "stop signal: 720 s before the kill" in text
    # torchrun's rendezvous across the hosts; every rank on the veth, not loopback.
    nodes = [ln for ln in text.splitlines() if ln.startswith("[node of rank ") and "(route to " in ln]
    # (one line a node: its first rank's)
    assert len(nodes) == 2 and all("NCCL_SOCKET_IFNAME=sdpo0" in ln and "GLOO_SOCKET_IFNAME=sdpo0" in ln for ln in nodes), nodes
    assert sum("from 10.231.0.12" in ln for ln in nodes) == 1, nodes
    run = sub / "run"
    assert (run / "report.md").is_file() and (run / "eval_matrix.csv").is_file()
    assert [(s, k) for s, k, _ in rewards(run)] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
