"""Which process this is in a torchrun / srun launch, and the few collectives the loop needs.

Every rank runs the same loop (same seeds, so the same rollouts and evals: with vLLM each
rollout replica generates its share and the completions are gathered to every rank, see
rollout/replicas.py); the backend trains on its slice of each global batch. Only rank 0 writes
the run directory.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """WORLD_SIZE of the launch (1 for a plain `python -m megatron_sdpo`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_if_launched(timeout_minutes: float = 30.0) -> None:
    """Join the launch's process group (gloo on CPU, NCCL on CUDA) when started by torchrun; a
    collective that waits `timeout_minutes` for a rank fails the job instead of hanging."""
    if launched_world_size() > 1 and not dist.is_initialized():
        from megatron_sdpo.errors import ConfigError

        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(f"WORLD_SIZE > 1 but {missing} are not set (launch with torchrun)")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", launched_world_size()))
        if local < launched_world_size():
            # Across nodes: the sockets leave by the route to MASTER_ADDR (network.py).
            from megatron_sdpo.network import choose

            lines = choose()
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"[node of rank {os.environ['RANK']}] " + "; ".join(lines), flush=True)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def from_main(value):
    """`value` as the main rank holds it, on every rank (one broadcast; the value itself without
    a process group): a decision every rank must share, made where the files are written."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
