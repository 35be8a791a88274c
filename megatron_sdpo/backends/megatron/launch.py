"""Spawn a small gloo world in-process (tests, CPU runs) with a hard timeout per rank.

Each rank runs `fn(*args)` after `init_process_group`; its return value comes back through a
file. A rank that hangs past `timeout_s` dumps every thread's stack (faulthandler) to its log
and exits, so a deadlock in a collective surfaces as a traceback instead of a stuck job.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, fn: Callable, args: tuple, workdir: str, timeout_s: float, threads: int
):
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w", buffering=1)
    faulthandler.enable(file=log)
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=log)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        if not torch.cuda.is_available():
            from megatron_sdpo.backends.megatron import cpu

            cpu.install()
        from megatron_sdpo.backends.megatron.parallel import init_distributed

        init_distributed(timeout_s=timeout_s)
        result = fn(*args)
        torch.save(result, os.path.join(workdir, f"rank{rank}.pt"))
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc(file=log)
        log.flush()
        # Helpers this rank started (e.g. dist_checkpointing's writer processes) would outlive
        # an os._exit as orphans.
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    log.close()


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, threads: int = 1) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh processes over gloo; return each rank's result.

    `fn` must be importable by module path (a module-level function). Raises RuntimeError with
    the failing ranks' logs (traceback or stack dump) when a rank fails or times out.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mcore-world-") as workdir:
        port = free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, workdir, timeout_s, threads))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 30.0
        failed = False
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                failed = True
                break
            time.sleep(0.05)
        if failed:
            # Give the others their faulthandler dump, then stop them.
            time.sleep(1.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        if failed or any(c != 0 for c in codes):
            logs = []
            for r in range(world_size):
                path = Path(workdir, f"rank{r}.log")
                text = path.read_text() if path.exists() else "(no log)"
                logs.append(f"--- rank {r} (exit {codes[r]}) ---\n{text[-6000:]}")
            raise RuntimeError(f"distributed run of {fn.__name__} failed:\n" + "\n".join(logs))
        return [torch.load(Path(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("import megatron_sdpo.backends.megatron.launch and call spawn()")
