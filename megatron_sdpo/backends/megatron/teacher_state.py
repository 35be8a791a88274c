"""The Megatron teacher's fp32 EMA state when the model runs in bf16.

An EMA step of rate 0.05 is below half a bf16 ULP until student and teacher differ by ~10 ULPs,
so a bf16 teacher updated in place barely moves. With bf16 params the teacher keeps an fp32
shadow of its (TP/PP-local) shards, blended from the optimizer's fp32 main parameters, and the
bf16 teacher used for forwards is the one rounding of the shadow.

megatron's optimizers hold the main parameters differently:
- Float16OptimizerWithFloat16Params (no distributed optimizer): a full fp32 copy per param.
- DistributedOptimizer: each DP rank owns a contiguous range of every param's flattened
  elements (`_get_model_param_range_map(p)["param"]`) and holds only that range in fp32.
In the second case each rank updates the shadow on its own ranges and the ranges are combined by
an all-reduce (sum) over the optimizer's DP group in which the other ranks contribute zeros:
exact, since every element has one owner. The shadow is then the same full tensor on every DP
rank, which is what makes it saveable independently of the DP size.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megatron_sdpo.algorithms.blend import TeacherBlend, blend_, copy_
from megatron_sdpo.errors import ConfigError


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_params(optimizer, params: Iterable[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, int, int]], object]:
    """For each model param (in order): (flat fp32 main values, start, end), the elements
    [start, end) of the param's flattened view that this rank's optimizer holds in fp32; and the
    process group over which the ranges are split (None when every rank holds every element)."""
    found: dict[int, tuple[torch.Tensor, int, int]] = {}
    elsewhere: set[int] = set()  # params whose elements other DP ranks own entirely
    group = None
    for opt in _optimizers(optimizer):
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                     *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
            for models, mains in pairs:
                for p, main in zip(models, mains):
                    r = opt._get_model_param_range_map(p)["param"]
                    found[id(p)] = (main.detach().view(-1), r.start, r.end)
            elsewhere.update(id(p) for buf in opt.buffers for p in buf.param_index_map)
            group = opt.data_parallel_group
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(models, mains):
                    found[id(p)] = (main.detach().view(-1), 0, p.numel())
            for models in opt.fp32_from_fp32_groups:
                for p in models:
                    found[id(p)] = (p.detach().view(-1), 0, p.numel())
        else:  # fp32 params: the optimizer updates the params themselves
            for g in opt.param_groups:
                for p in g["params"]:
                    found[id(p)] = (p.detach().view(-1), 0, p.numel())
    out = []
    for k, p in enumerate(params):
        if id(p) not in found and id(p) in elsewhere:
            found[id(p)] = (torch.empty(0, dtype=torch.float32, device=p.device), 0, 0)
        if id(p) not in found:
            raise ConfigError(f"policy parameter {k} (shape {tuple(p.shape)}) is not owned by the optimizer")
        out.append(found[id(p)])
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return out, group


class FP32TeacherShadow:
    """fp32 copy of the teacher's local shards; `blend` applies a teacher update to it from the
    optimizer's fp32 main params and rounds the result once into the teacher."""

    def __init__(self, teacher_params: list[torch.Tensor]):
        self.shadow = [t.detach().to(torch.float32).clone() for t in teacher_params]

    @torch.no_grad()
    def blend(
        self, blend: TeacherBlend, teacher_params: list[torch.Tensor], policy_params: list[torch.Tensor], optimizer,
        *, reference: list[torch.Tensor] | None = None,
    ) -> None:
        """shadow <- blend(shadow, student main params, reference params); then
        teacher <- bf16(shadow). Collective over the DP group with the distributed optimizer."""
        if blend.is_identity:
            return
        mains, group = main_params(optimizer, policy_params)
        if len(mains) != len(self.shadow):
            raise ValueError(f"teacher has {len(self.shadow)} tensors but the policy {len(mains)}")
        refs = reference if reference is not None else [None] * len(mains)

        def sources(main: torch.Tensor, ref: torch.Tensor | None, a: int, b: int) -> dict:
            out = {"policy": [main]}
            if ref is not None:
                out["reference"] = [ref.detach().view(-1)[a:b]]
            return out

        if group is None:
            for sh, (main, a, b), ref in zip(self.shadow, mains, refs):
                blend_([sh.view(-1)[a:b]], sources(main, ref, a, b), blend)
        else:
            sizes = [sh.numel() for sh in self.shadow]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.shadow[0].device)
            offset = 0
            for sh, (main, a, b), ref, n in zip(self.shadow, mains, refs, sizes):
                if b > a:
                    own = sh.view(-1)[a:b].clone()
                    blend_([own], sources(main, ref, a, b), blend)
                    flat[offset + a : offset + b] = own
                offset += n
            dist.all_reduce(flat, group=group)
            offset = 0
            for sh, n in zip(self.shadow, sizes):
                sh.view(-1).copy_(flat[offset : offset + n])
                offset += n
        copy_(teacher_params, self.shadow)

    @torch.no_grad()
    def resync(self, teacher_params: list[torch.Tensor]) -> None:
        """shadow <- the teacher's current weights (after loading them from elsewhere)."""
        copy_(self.shadow, [t.detach() for t in teacher_params])
