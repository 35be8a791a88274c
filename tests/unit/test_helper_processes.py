"""A rank's helper processes (the math verifier's worker, dist_checkpointing's writer queue)
ignore the stop signals, which are the rank's to act on, and die with the rank however it dies:
a helper that a rank's SIGKILL left behind lives on under init, outside the scheduler's process
tracking (seen under torchrun before this)."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")

MATH_PARENT = """
from megatron_sdpo.rewards.math import MathVerifier
v = MathVerifier()
assert v.check("2", "2")["correct"]
print(v._proc.pid, flush=True)
import time; time.sleep(600)
"""
QUEUE_PARENT = """
from megatron_sdpo.backends.megatron.checkpoint import _start_writer_queue
from megatron.core.dist_checkpointing.strategies import filesystem_async
_start_writer_queue()
filesystem_async._results_queue.put(1)
import multiprocessing
print(multiprocessing.active_children()[0].pid, flush=True)
import time; time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _helper_of(code: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the parent did not start its helper: {line!r}"
    return parent, int(line)


def _check(code: str) -> None:
    parent, helper = _helper_of(code)
    try:
        os.kill(helper, signal.SIGTERM)  # as a scheduler signals every process of the job
        os.kill(helper, signal.SIGUSR1)
        time.sleep(1.0)
        assert _alive(helper), "the helper died of a stop signal meant for its rank"
        parent.kill()  # the rank dies without any clean-up
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(helper), "the helper outlived its rank"
    finally:
        parent.kill()
        if _alive(helper):
            os.kill(helper, signal.SIGKILL)


def test_the_math_workers_end_with_their_rank():
    pytest.importorskip("math_verify")
    _check(MATH_PARENT)


@pytest.mark.megatron
def test_the_checkpoint_writer_queue_ends_with_its_rank():
    _check(QUEUE_PARENT)
