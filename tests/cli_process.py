"""The CLI as a child process, for the end-to-end tests that kill a run or a study mid-way.

Importable from every test folder: pytest puts tests/ (the conftest's folder) on sys.path.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def cli(*args, cwd, **kw) -> subprocess.Popen:
    """`python -m megatron_sdpo ARGS` in `cwd`, one torch thread, stdout and stderr together."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_sdpo", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw,
    )


def kill_when(proc: subprocess.Popen, marker: Path, what: str, timeout: float = 900) -> None:
    """SIGKILL `proc`'s process group (started with start_new_session=True) as soon as `marker`
    exists: no chance to clean up. `what`: the awaited event, named in the failure messages."""
    deadline = time.time() + timeout
    while not marker.exists():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.time() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
