"""The Megatron teacher's fp32 EMA state when the model runs in bf16.

An EMA step of rate 0.05 is below half a bf16 ULP until student and teacher differ by ~10 ULPs,
so a bf16 teacher updated in place barely moves. With bf16 params the teacher keeps an fp32
shadow of its (TP/PP-local) shards, blended from the optimizer's fp32 main parameters, and the
bf16 teacher used for forwards is the one rounding of the shadow.

megatron's optimizers hold the main parameters differently:
- Float16OptimizerWithFloat16Params (no distributed optimizer): a full fp32 copy per param; the
  shadow is a full fp32 copy too.
- DistributedOptimizer: each DP rank owns a contiguous range of every param's flattened
  elements (`_get_model_param_range_map(p)["param"]`, the rank's shard of each DDP bucket) and
  holds only that range in fp32. The shadow is sharded the same way: each rank keeps and blends
  only the elements it owns (1/DP of the bytes), and the bf16 teacher is rebuilt bucket by bucket
  with one all-gather of the rounded shards into a bucket-sized bf16 buffer, as the distributed
  optimizer gathers the policy's params. No full-size fp32 buffer, no all-reduce.
Checkpoints save each rank's pieces with their element ranges, so a load reassembles them under
any data-parallel size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.blend import TeacherBlend, blend_


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_params(
    optimizer, params: Iterable[torch.Tensor]
) -> tuple[list[tuple[torch.Tensor, int, int]], dist.ProcessGroup | None]:
    """For each model param (in order): (flat fp32 main values, start, end), the elements
    [start, end) of the param's flattened view that this rank's optimizer holds in fp32; and the
    process group over which the ranges are split (None when every rank holds every element)."""
    found: dict[int, tuple[torch.Tensor, int, int]] = {}
    elsewhere: set[int] = set()  # params whose elements other DP ranks own entirely
    group = None
    for opt in _optimizers(optimizer):
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = [
                *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
                *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
            ]
            for models, mains in pairs:
                for p, main in zip(models, mains, strict=True):
                    r = opt._get_model_param_range_map(p)["param"]
                    found[id(p)] = (main.detach().view(-1), r.start, r.end)
            elsewhere.update(id(p) for buf in opt.buffers for p in buf.param_index_map)
            group = opt.data_parallel_group
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                for p, main in zip(models, mains, strict=True):
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


@dataclass(frozen=True)
class _Bucket:
    """One DDP bucket of the policy: its bf16 size (padded to a multiple of DP), this rank's
    shard of it, and (param index, offset in the bucket) of its params."""

    numel: int
    shard: int
    members: list[tuple[int, int]]


def _bucket_layout(ddp, policy_params: list[torch.Tensor], group) -> list[_Bucket]:
    index = {id(p): k for k, p in enumerate(policy_params)}
    dp = dist.get_world_size(group)
    out = []
    for buf in [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]:
        for bucket in buf.buckets:
            n = bucket.param_data.numel()
            members = [(index[id(p)], buf.param_index_map[p][0] - bucket.offset) for p in bucket.params_list]
            out.append(_Bucket(n, n // dp, members))
    return out


class FP32TeacherShadow:
    """fp32 copy of the elements of the teacher's local shards this rank's optimizer owns (all
    of them without the distributed optimizer); `blend` applies a teacher update to it from the
    optimizer's fp32 main params and rounds the result once into the teacher."""

    def __init__(self, teacher_params: list[torch.Tensor], policy_params: list[torch.Tensor], optimizer, ddp=None):
        mains, self.group = main_params(optimizer, policy_params)
        self.shapes = [tuple(t.shape) for t in teacher_params]
        self.ranges = [
            (a, b) if self.group is not None else (0, t.numel())
            for (_, a, b), t in zip(mains, teacher_params, strict=True)
        ]
        self.offsets = [0]
        for a, b in self.ranges:
            self.offsets.append(self.offsets[-1] + b - a)
        # One allocation for every piece: 1/DP of the teacher's elements under the distributed optimizer.
        self.local = torch.empty(self.offsets[-1], dtype=torch.float32, device=teacher_params[0].device)
        self.buckets = _bucket_layout(ddp, policy_params, self.group) if self.group is not None else []
        if self.group is not None:
            self._check_layout()
        self.resync(teacher_params)

    def _check_layout(self) -> None:
        """Every param in one bucket, and the optimizer's ranges are this rank's bucket shards."""
        r = dist.get_rank(self.group)
        seen = [k for b in self.buckets for k, _ in b.members]
        if sorted(seen) != list(range(len(self.ranges))):
            raise ConfigError("teacher shadow: the policy's DDP buckets do not hold every parameter once")
        for b in self.buckets:
            lo, hi = r * b.shard, (r + 1) * b.shard
            for k, off in b.members:
                n = math.prod(self.shapes[k])
                a, e = max(lo, off) - off, min(hi, off + n) - off
                if (a, e) != self.ranges[k] and not (e <= a and self.ranges[k][1] <= self.ranges[k][0]):
                    raise ConfigError(
                        f"teacher shadow: param {k} owns {self.ranges[k]} but its bucket shard is {(a, e)}"
                    )

    def piece(self, k: int) -> torch.Tensor:
        """The fp32 shadow of param k's owned elements [a, b) (flat)."""
        return self.local[self.offsets[k] : self.offsets[k + 1]]

    @property
    def sharded(self) -> bool:
        return self.group is not None

    def full(self) -> list[torch.Tensor]:
        """The shadow as full-shape fp32 tensors; elements another DP rank owns are NaN."""
        out = []
        for k, (a, b) in enumerate(self.ranges):
            t = torch.full((math.prod(self.shapes[k]),), float("nan"), dtype=torch.float32, device=self.local.device)
            t[a:b] = self.piece(k)
            out.append(t.view(self.shapes[k]))
        return out

    @torch.no_grad()
    def blend(
        self,
        blend: TeacherBlend,
        teacher_params: list[torch.Tensor],
        policy_params: list[torch.Tensor],
        optimizer,
        *,
        reference: list[torch.Tensor] | None = None,
    ) -> None:
        """shadow <- blend(shadow, student main params, reference params); then
        teacher <- bf16(shadow). Collective over the DP group with the distributed optimizer."""
        if blend.is_identity:
            return
        mains, _ = main_params(optimizer, policy_params)
        if len(mains) != len(self.ranges):
            raise ValueError(f"teacher has {len(self.ranges)} tensors but the policy {len(mains)}")
        refs = reference if reference is not None else [None] * len(mains)
        for k, ((main, a, b), ref) in enumerate(zip(mains, refs, strict=True)):
            if (a, b) != self.ranges[k] and self.sharded:
                raise ConfigError(
                    f"teacher shadow: param {k}'s optimizer range moved from {self.ranges[k]} to {(a, b)}"
                )
            if b <= a:
                continue
            sources = {"policy": [main]}
            if ref is not None:
                sources["reference"] = [ref.detach().view(-1)[a:b]]
            blend_([self.piece(k)], sources, blend)
        self._round_into(teacher_params)

    def _round_into(self, teacher_params: list[torch.Tensor]) -> None:
        if not self.sharded:
            for k, t in enumerate(teacher_params):
                t.view(-1).copy_(self.piece(k))
            return
        r = dist.get_rank(self.group)
        dtype, device = teacher_params[0].dtype, teacher_params[0].device
        for b in self.buckets:
            gathered = torch.zeros(b.numel, dtype=dtype, device=device)  # one bucket at a time
            mine = torch.zeros(b.shard, dtype=dtype, device=device)
            for k, off in b.members:
                a, e = self.ranges[k]
                if e > a:
                    mine[off + a - r * b.shard : off + e - r * b.shard].copy_(self.piece(k))
            dist.all_gather_into_tensor(gathered, mine, group=self.group)
            for k, off in b.members:
                t = teacher_params[k]
                t.view(-1).copy_(gathered[off : off + t.numel()])

    @torch.no_grad()
    def resync(self, teacher_params: list[torch.Tensor]) -> None:
        """shadow <- the teacher's current weights (after loading them from elsewhere)."""
        for k, (t, (a, b)) in enumerate(zip(teacher_params, self.ranges, strict=True)):
            self.piece(k).copy_(t.detach().view(-1)[a:b])

    def state(self) -> dict:
        """What a checkpoint keeps: the pieces and where they sit in each param."""
        return {"shapes": self.shapes, "ranges": self.ranges, "values": self.local.detach().cpu()}

    @torch.no_grad()
    def load_states(self, states: list[dict], where: str) -> None:
        """Fill this rank's pieces from the pieces saved by every DP rank of a checkpoint (any
        data-parallel size); every element this rank owns must be among them."""
        from megatron_sdpo.errors import CheckpointError

        for st in states:
            if [tuple(s) for s in st["shapes"]] != self.shapes:
                raise CheckpointError(f"{where}: the saved teacher shadow's shapes differ from this teacher's")
        starts = [[0, *itertools.accumulate(e - s for s, e in st["ranges"])] for st in states]
        for k, (a, b) in enumerate(self.ranges):
            if b <= a:
                continue
            covered = torch.zeros(b - a, dtype=torch.bool, device="cpu")  # host bookkeeping
            dst = self.piece(k)
            for st, start in zip(states, starts, strict=True):
                sa, sb = st["ranges"][k]
                lo, hi = max(a, sa), min(b, sb)
                if hi > lo:
                    off = start[k]
                    dst[lo - a : hi - a].copy_(st["values"][off + lo - sa : off + hi - sa])
                    covered[lo - a : hi - a] = True
            if not bool(covered.all()):
                raise CheckpointError(f"{where}: the saved teacher shadow misses elements of parameter {k}")
