"""Moving weights between a live megatron model (sharded over TP/PP) and HF names.

`load_hf` fills this rank's shard from HF tensors (a dict or a lazy mapping such as a
safetensors reader: only the tensors this stage needs are read). `export_hf` streams
(HF name, full tensor) pairs on every rank, one megatron tensor at a time: the owning stage
gathers it over its TP group, then broadcasts it over the PP group.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Mapping as MappingT

import torch
import torch.distributed as dist

from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.weights.convert import full_to_hf, hf_to_full, shard, unshard
from megatron_sdpo.weights.plan import Layout, ModelSpec, plan


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Megatron DDP wraps the GPTModel as `.module`; names are the GPTModel's own.
    inner = getattr(model, "module", model)
    return dict(inner.named_parameters())


@torch.no_grad()
def load_hf(
    model: torch.nn.Module, hf: MappingT[str, torch.Tensor], spec: ModelSpec, layout: Layout, tp_rank: int, pp_rank: int
) -> None:
    """Copy HF tensors into this rank's parameters (in place, dtype cast to the parameter's).

    Raises CheckpointError if the model has a parameter the plan does not cover or vice versa."""
    params = _params(model)
    mps = plan(spec, layout, pp_rank)
    want = {mp.megatron for mp in mps}
    if set(params) != want:
        raise CheckpointError(
            f"megatron model and weight plan disagree: model-only {sorted(set(params) - want)[:4]}, "
            f"plan-only {sorted(want - set(params))[:4]}"
        )
    for mp in mps:
        t = shard(mp, hf_to_full(spec, mp, hf), layout.tp, tp_rank)
        p = params[mp.megatron]
        if tuple(p.shape) != tuple(t.shape):
            raise CheckpointError(f"{mp.megatron}: shard shape {tuple(t.shape)} != parameter {tuple(p.shape)}")
        p.copy_(t.to(device=p.device, dtype=p.dtype))


@torch.no_grad()
def export_hf(
    model: torch.nn.Module,
    spec: ModelSpec,
    layout: Layout,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    pp_rank: int,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) on every rank of the TP x PP grid, stage by stage.

    Collective: every rank of the model-parallel grid must consume the iterator in step. At most
    one gathered megatron tensor (plus its HF pieces) is alive at a time. Receive buffers are
    made on `device` (default: where this rank's parameters live), which must suit the groups'
    backend (the model's GPU under NCCL)."""
    params = _params(model) if model is not None else {}
    if device is None:
        if not params:
            raise CheckpointError("export_hf needs `device` when this rank has no parameters")
        device = next(iter(params.values())).device
    seen: set[str] = set()
    for p in range(layout.pp):
        for mp in plan(spec, layout, p):
            if all(n in seen for n in mp.hf):
                continue  # the last stage's copy of a tied embedding
            if p == pp_rank:
                local = params[mp.megatron].detach()
                out_dtype = dtype or local.dtype
                local = local.to(out_dtype).contiguous()
                if layout.tp > 1 and mp.kind != "replicated":
                    parts = [torch.empty_like(local) for _ in range(layout.tp)]
                    dist.all_gather(parts, local, group=tp_group)
                    full = unshard(mp, parts)
                else:
                    full = local.clone()
            else:
                full = torch.empty(mp.shape, dtype=dtype or next(iter(params.values())).dtype, device=device)
            if layout.pp > 1:
                if pp_group is None:
                    raise ValueError("pipeline parallelism needs pp_group")
                full = full.contiguous()
                dist.broadcast(full, src=dist.get_global_rank(pp_group, p), group=pp_group)
            for n, t in full_to_hf(spec, mp, full).items():
                seen.add(n)
                yield n, t
