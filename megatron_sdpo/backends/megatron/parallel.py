"""Parallel layout: TP x PP x DP validated against the world size, megatron parallel state.

Rank order is megatron's default ("tp-cp-ep-dp-pp"): TP ranks are adjacent, so a TP group never
spans nodes before a DP group does.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sdpo.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    """User-facing parallel settings; DP is whatever the world size leaves."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False

    def resolve(self, world_size: int) -> ParallelLayout:
        """The full layout for `world_size` ranks, or ConfigError naming the offending key."""
        for key in ("tp", "pp"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{key}={v!r} must be a positive integer")
        if world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {self.tp} * {self.pp}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=True needs parallel.tp > 1")
        return ParallelLayout(self.tp, self.pp, world_size // (self.tp * self.pp), self.sequence_parallel)


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialize torch.distributed from the usual env (RANK, WORLD_SIZE, MASTER_*), if not yet.

    gloo on CPU, nccl where CUDA is available. A missing rendezvous variable is a ConfigError
    (not a hang on an unset MASTER_ADDR)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"distributed launch variables {missing} are not set (launch with torchrun)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def launch_device() -> torch.device:
    """The device this rank's models live on: cuda:LOCAL_RANK where CUDA is available (the
    device `init_distributed` binds NCCL to), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where buffers handed to collectives on `group` must live: CUDA for NCCL, CPU for gloo."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize(config: ParallelConfig, seed: int = 1234) -> ParallelLayout:
    """Set up megatron's parallel state for `config` on the initialized world; seed megatron's
    RNG tracker (the CPU shim must already be installed on CPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialized; call init_distributed() first")
    layout = config.resolve(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (layout.tp, layout.pp):
            raise ConfigError(f"megatron parallel state is already initialized with (tp, pp)={have}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return layout


def destroy() -> None:
    """Tear down megatron's parallel state (the process group stays)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def ranks() -> dict[str, int]:
    """This process's coordinates: tp, pp, dp ranks."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }
