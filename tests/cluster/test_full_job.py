"""`sbatch slurm/continual_7b.sh` as GPU users run it (the megatron backend at TP 2, colocated vLLM
replicas of TP 2, torchrun across two hosts), made a tiny CPU job by overrides and environment
variables only: 2 nodes x 2 ranks over gloo."""

import re
from pathlib import Path

import pytest

from jobs import TINY, job_env, log_of, no_job_processes, rewards, sbatch, submit_dir, wait_state

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.megatron, pytest.mark.vllm]

SCRIPT = "continual_7b.sh"
MEGATRON = [
    "backend.megatron.tensor_parallel=2",
    "backend.megatron.params_dtype=float32",
    "rollout.tensor_parallel_size=2",
]


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
    assert len(nodes) == 2 and all(
        "NCCL_SOCKET_IFNAME=sdpo0" in ln and "GLOO_SOCKET_IFNAME=sdpo0" in ln for ln in nodes
    ), nodes
    assert sum("from 10.231.0.12" in ln for ln in nodes) == 1, nodes
    run = sub / "run"
    assert (run / "report.md").is_file() and (run / "eval_matrix.csv").is_file()
    assert [(s, k) for s, k, _ in rewards(run)] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    # What each node wrote at the last save, against the plan's per-node figure (the stop grace's).
    from megatron_sdpo.config import load_config
    from megatron_sdpo.planning.launch_plan import plan

    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    written = _bytes_by_node(latest, tp=2, dp=2, ranks_per_node=2)
    planned = plan(load_config("olmo3_7b", [*TINY, *MEGATRON]), 4).ledger.node_save_bytes(2)
    print(f"bytes written at a save, by node: {written} (planned {planned})")
    assert abs(written[0] - planned[0]) <= 0.1 * planned[0], (written, planned)
    assert written[1] - planned[1] <= 0.01 * planned[0], (written, planned)  # its RNG states only


def _bytes_by_node(checkpoint: Path, *, tp: int, dp: int, ranks_per_node: int) -> list[int]:
    """Each file of a megatron checkpoint by the rank that writes it (backends/megatron/checkpoint.py):
    __R_K.distcp and rng/rankR.pt by global rank R, the teacher shadow's tp{t}_pp{p}_dp{d}.pt by
    its rank, the rest (the HF policy, metadata) by rank 0."""
    nodes = [0, 0]
    for f in checkpoint.rglob("*"):
        if not f.is_file():
            continue
        rel = f.relative_to(checkpoint).as_posix()
        m = re.fullmatch(r"__(\d+)_\d+\.distcp|rng/rank(\d+)\.pt", rel)
        shadow = re.fullmatch(r"teacher_fp32/tp(\d+)_pp(\d+)_dp(\d+)\.pt", rel)
        if m:
            rank = int(m.group(1) or m.group(2))
        elif shadow:
            t, p, d = map(int, shadow.groups())
            rank = t + tp * (d + dp * p)
        else:
            rank = 0
        nodes[rank // ranks_per_node] += f.stat().st_size
    return nodes
