"""The CLI as a child process, for the end-to-end tests that kill a run or a study mid-way, and
the CLI's command under torchrun for the multi-rank tests.

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
        [sys.executable, "-m", "megatron_sdpo", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        **kw,
    )


def torchrun_cli(ranks: int, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    """The command of `python -m megatron_sdpo ARGS` on `ranks` local ranks under torchrun;
    `launcher`: more torchrun options."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    return [*torchrun, *launcher, "-m", "megatron_sdpo", *args]


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 900, poll: float = 0.1) -> None:
    """Poll `ready()` until it holds; fail, with the process's output, if `proc` ends first or
    `timeout` seconds pass. `what`: the awaited event, named in the failure messages."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the job ended before {what}: {proc.communicate()[0][-3000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def kill_when(proc: subprocess.Popen, marker: Path, what: str, timeout: float = 900) -> None:
    """SIGKILL `proc`'s process group (started with start_new_session=True) as soon as `marker`
    exists: no chance to clean up."""
    wait_for(proc, marker.exists, what, timeout)
    os.killpg(proc.pid, signal.SIGKILL)
