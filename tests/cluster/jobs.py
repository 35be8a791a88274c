"""Submitting the repository's sbatch scripts to the test cluster and watching their jobs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODES = ("sdpo-node1", "sdpo-node2")

# What makes a paper preset a tiny CPU job: the packaged tiny model in fp32, two stages of three
# steps on synthetic data, short answers. Only key=value overrides: the scripts are unchanged.
_SPLIT = "{source: synthetic, schema: records, n: 16, extra_files: []}"
TINY = [
    "model.path=tiny",
    "model.dtype=float32",
    "stages=[{domain: math, steps: 3}, {domain: science, steps: 3}]",
    "domains.tooluse=null",
    "domains.code=null",
    *(
        f"domains.{d}.{s}={_SPLIT}"
        for d in ("math", "science")
        for s in ("train", "eval.id", "eval.ood_near", "eval.ood_mid", "eval.ood_far")
    ),
    "rollout.max_new_tokens=16",
    "rollout.max_model_len=384",
    "eval.max_new_tokens=16",
    "algorithm.prompts_per_step=4",
    "algorithm.group_size=4",
    "backend.lr_schedule.warmup_steps=0",
]
# The smallest job that spans two hosts: one rank a node, the HF backend and HF generation.
TINY_HF = [*TINY, "backend=hf", "rollout.engine=hf", "rollout.tensor_parallel_size=1", "backend.micro_batch_size=16"]

SHIM = """#!/bin/sh
# `python -m megatron_sdpo ...` runs tests/cluster/slowed_run.py; anything else is the interpreter.
if [ "$1" = "-m" ] && [ "$2" = "megatron_sdpo" ]; then shift 2; exec "{python}" "{slowed}" "$@"; fi
exec "{python}" "$@"
"""


def submit_dir(tmp: Path) -> Path:
    """A submit directory as a user has it: the repository's slurm/ (runs and logs go here), and
    a `python` on PATH (bin/) that can slow the rollout."""
    tmp.mkdir(parents=True, exist_ok=True)
    if not (tmp / "slurm").exists():
        (tmp / "slurm").symlink_to(REPO / "slurm", target_is_directory=True)
    (tmp / "logs").mkdir(exist_ok=True)
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(
        SHIM.format(python=sys.executable, slowed=REPO / "tests" / "cluster" / "slowed_run.py")
    )
    (bin_dir / "python").chmod(0o755)
    return tmp


def job_env(cluster: dict, sub: Path, **extra: str) -> dict:
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        **cluster,
        "PATH": f"{sub / 'bin'}{os.pathsep}{venv_bin}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "SDPO_TEST_SLOW_FLAG": str(sub / "slow"),
        "WANDB_MODE": "offline",
    }
    env.update(extra)
    return env


def sbatch(script: str, sub: Path, env: dict, *args: str, sbatch_args: tuple[str, ...] = ()) -> int:
    out = subprocess.run(
        ["sbatch", "--parsable", *sbatch_args, f"slurm/{script}", *args],
        cwd=sub,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def job(job_id: int, env: dict) -> dict[str, str]:
    """scontrol's fields of the job (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], env=env, capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_state(job_id: int, env: dict, states: set[str], timeout: float, log: Path | None = None) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        info = job(job_id, env)
        if info.get("JobState") in states:
            return info
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log and log.exists() else ""
            raise AssertionError(f"job {job_id} not in {states} after {timeout:.0f} s: {info.get('JobState')}\n{tail}")
        time.sleep(1.0)


def wait_for(what: str, ready, timeout: float, poll: float = 0.2) -> float:
    t0 = time.monotonic()
    while not ready():
        assert time.monotonic() - t0 < timeout, f"no {what} after {timeout:.0f} s"
        time.sleep(poll)
    return time.monotonic() - t0


def log_of(sub: Path, script: str, job_id: int) -> Path:
    name = {"continual_4b.sh": "sdpo-qwen3-4b", "continual_7b.sh": "sdpo-olmo3-7b"}[script]
    return sub / "logs" / f"{name}-{job_id}.out"


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def rewards(run: Path) -> list[tuple[int, int, float]]:
    return [(m["stage"], m["step"], m["reward_mean"]) for m in records(run)]


def node_processes() -> dict[str, list[str]]:
    """Each node's processes other than its slurmd: what a finished job must not leave."""
    found = {}
    for node in NODES:
        pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
        rest = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue  # ended meanwhile
            if cmd and not re.match(r"^(\S*/)?slurmd\b", cmd):
                rest.append(f"{pid} {cmd[:160]}")
        found[node] = rest
    return found


def no_job_processes(timeout: float = 30) -> None:
    """Every process of the job ended (engine and reward workers included) within `timeout`."""
    deadline = time.monotonic() + timeout
    while any(node_processes().values()):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes outlived their job: {node_processes()}")
        time.sleep(0.5)


def copy_run(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
