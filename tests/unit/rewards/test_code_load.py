"""The code verifier's verdict does not depend on the machine's load.

One CPU is saturated by four busy-loop processes pinned to it, and the sandbox runs pinned to the
same CPU, so a case gets about a fifth of it (the other cores and the rest of the machine are
left alone; the hogs end by themselves after a minute at most). The same correct and wrong
programs are scored on that CPU with and without the hogs: identical scores. That the load is real
is checked on the old verdict: a wall-clock limit equal to the CPU limit turns the correct program
that needs 0.4 s of CPU (2 s of wall time at a fifth of a CPU) into a time-out.
"""

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

from megatron_sdpo.rewards.code import score_code_batch
from megatron_sdpo.rewards.sandbox import Sandbox, SandboxLimits

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")

HOGS = 4
# 1 s of CPU per case; the wall backstop is 10 s. CPU_BOUND burns 0.4 s of its own CPU time, a
# margin of 2.5x below the limit, and at a fifth of a CPU needs 2 s of wall time, 2x above the
# old wall limit of 1 s.
LIMITS = SandboxLimits(timeout_s=1.0, cpu_s=1)
OLD_WALL_VERDICT = replace(LIMITS, wall_factor=1.0)  # wall limit = max(timeout_s, cpu_s) = 1 s
BURN = "import time\nwhile time.process_time() < 0.4:\n    pass\n"
CPU_BOUND = BURN + "n = int(input())\nprint(n * (n + 1) // 2)\n"
PROGRAMS = {
    "cpu-bound, right": (CPU_BOUND, 1.0),
    "cpu-bound, wrong": (BURN + "print(int(input()))\n", 0.0),
    "fast, right": ("n = int(input())\nprint(sum(range(n + 1)))\n", 1.0),
    "endless loop": ("while True:\n    pass\n", 0.0),
    "script, cpu-bound, right": (BURN + "def tri(n):\n    return n * (n + 1) // 2\n", 1.0),
    "script, wrong": ("def tri(n):\n    return n * n\n", 0.0),
}
STDIN = {"id": "tri", "tests": [{"input": "1000", "output": "500500"}]}
SCRIPT = {"id": "tri-script", "tests": [{"input": "assert tri(1000) == 500500", "output": "", "testtype": "code"}]}


def _score(limits: SandboxLimits, names=tuple(PROGRAMS)) -> dict[str, float]:
    responses = [f"```python\n{PROGRAMS[n][0]}```" for n in names]
    records = [SCRIPT if n.startswith("script") else STDIN for n in names]
    results = score_code_batch(responses, records, sandbox=Sandbox(limits))
    return {n: r.score for n, r in zip(names, results, strict=True)}


@contextmanager
def _pinned(cpu: int):
    """This process (and so every sandbox it starts) on one CPU only."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def _saturated(cpu: int):
    """HOGS busy loops on `cpu`, each ending by itself after 60 s; killed on leaving, by pid.
    Each in a session of its own, as the sandbox is: with the kernel's autogroup scheduling the
    CPU is shared between sessions first, and hogs in this one session would take half of it."""
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass"],
            start_new_session=True,
        )
        for _ in range(HOGS)
    ]
    try:
        for hog in hogs:
            os.sched_setaffinity(hog.pid, {cpu})
        time.sleep(0.2)  # running before the first case starts
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_scores_are_the_same_on_a_saturated_cpu():
    cpu = min(os.sched_getaffinity(0))
    expected = {n: want for n, (_, want) in PROGRAMS.items()}
    with _pinned(cpu):
        alone = _score(LIMITS)
        with _saturated(cpu):
            loaded = _score(LIMITS)
            old_verdict = _score(OLD_WALL_VERDICT, ("cpu-bound, right",))
    assert alone == expected
    assert loaded == alone
    # The load was real: judged on the wall clock, the correct CPU-bound program failed under it.
    assert old_verdict == {"cpu-bound, right": 0.0}
