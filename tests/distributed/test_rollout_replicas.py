"""Colocated vLLM on every rank of a torchrun launch: one TP=2 engine over both ranks (trainer
megatron TP=2), or two TP=1 replicas (trainer DP=2). Both must finish a small continual run and
reproduce the single-process run step for step.

Why equality is expected: every request is seeded from the step seed and the prompt's global
index (not from the replica or batch it lands in), the trainers agree to ~1e-6 in fp32, and a
sampled token could only change at a near-tie of that size, so rewards and greedy eval answers
are the same. (vLLM TP=2 sums its row-parallel matmuls in another order; the difference is of
the same size.)"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli_process import torchrun_cli

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.megatron, pytest.mark.vllm, pytest.mark.slow]

SMALL = """
defaults: tiny
name: replicas
stages:
  - {domain: math, steps: 2}
  - {domain: tooluse, steps: 1}
domains:
  math: {eval: {id: {n: 8}, ood_near: {n: 2}, ood_mid: {n: 2}, ood_far: {n: 2}}}
  science: {eval: {id: {n: 2}, ood_near: {n: 2}, ood_mid: {n: 2}, ood_far: {n: 2}}}
  tooluse: {eval: {id: {n: 6}, ood_near: {n: 2}, ood_mid: {n: 2}, ood_far: {n: 2}}}
  code: {eval: {id: {n: 2}, ood_near: {n: 2}, ood_mid: {n: 2}, ood_far: {n: 2}}}
algorithm: {prompts_per_step: 5, group_size: 4}
rollout: {engine: vllm, max_new_tokens: 16, bucket_bytes: 200000}
eval: {max_new_tokens: 16}
checkpoint: {save_every: 0}
diagnostics: {enabled: false}
"""
TIMEOUT_S = 600


def _run(cmd: list[str], cwd) -> str:
    """Runs a launch in its own session; on a hang every rank gets SIGABRT, which makes
    faulthandler print its stack, and the test fails with them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"launch hung after {TIMEOUT_S}s:\n{out[-8000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def _leave_segments_of_a_killed_launch() -> None:
    """What a killed TP=2 launch leaves on the node: its ranks' CPU all-reduce segments, by the
    names vLLM gives them under torchrun. The next launch must start regardless (it failed with
    EEXIST in every rank)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    for rank in (0, 1):
        seg = shm / f"-tp:0-[0-1]-cpushm_{rank}"
        if not seg.exists():
            seg.write_bytes(b"\0" * 4096)


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _single_run(d: Path, config: str) -> Path:
    """The reference run of `config` (YAML text): one process, in `d`; returns its run directory."""
    (d / "cfg.yaml").write_text(config)
    _run([sys.executable, "-m", "megatron_sdpo", "run", "cfg.yaml", "--out", "run", "--quiet"], d)
    return d / "run"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _single_run(tmp_path_factory.mktemp("single"), SMALL)


@pytest.mark.parametrize(
    "overrides",
    [
        ["backend.megatron.tensor_parallel=2", "rollout.tensor_parallel_size=2"],  # one engine over both ranks
        ["rollout.tensor_parallel_size=1"],  # two replicas, trainer DP=2
    ],
    ids=["vllm_tp2", "vllm_2_replicas"],
)
def test_two_rank_rollout_matches_single_process(tmp_path, single, overrides):
    (tmp_path / "cfg.yaml").write_text(SMALL)
    if "rollout.tensor_parallel_size=2" in overrides:
        _leave_segments_of_a_killed_launch()
    cmd = torchrun_cli(2, "run", "cfg.yaml", "backend=megatron", *overrides, "--out", "run", "--quiet")
    _run(cmd, tmp_path)
    assert not list(Path("/dev/shm").glob("-tp:0-*-cpushm_*")), "a clean exit leaves no segment"
    got, want = _metrics(tmp_path / "run"), _metrics(single)
    assert [(m["stage"], m["step"]) for m in got] == [(0, 1), (0, 2), (1, 1)]
    assert all(m["samples"] == 20 for m in got)  # the global batch on every layout
    assert [m["reward_mean"] for m in got] == [m["reward_mean"] for m in want]
    assert [m["response_len"] for m in got] == [m["response_len"] for m in want]
    # The engines sample from the trainer's weights: fp32 on both sides (as in the vLLM unit tests).
    assert all(m["refit/logprob_diff_max"] <= 1e-4 for m in got), [m["refit/logprob_diff_max"] for m in got]
    assert all(m["sync_buckets"] > 1 for m in got)
    # Greedy eval, split over the replicas and gathered, gives the single-process matrix.
    assert (tmp_path / "run" / "eval_matrix.csv").read_text() == (single / "eval_matrix.csv").read_text()
