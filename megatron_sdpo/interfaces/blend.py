"""The teacher update as data: a convex blend of weight sets with one layout, and its in-place
application to a list of shards.

Each rank passes its local shards of the weight sets in the same order, so any backend -- plain
torch, DDP, Megatron TP/PP -- applies a blend with no communication of its own. This module is
the seam type the backends share with the teacher schedules (algorithms/teacher.py): torch only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

# The weight sets a blend draws on besides the teacher itself.
SOURCES = ("policy", "reference")


@dataclass(frozen=True)
class TeacherBlend:
    """The teacher update theta_T <- policy * theta_S + teacher * theta_T + reference * theta_B
    (theta_B: the base model, which the frozen reference holds). Weights are >= 0 and sum to 1;
    the default keeps the teacher as it is."""

    policy: float = 0.0
    teacher: float = 1.0
    reference: float = 0.0

    def __post_init__(self) -> None:
        ws = (self.policy, self.teacher, self.reference)
        if not all(math.isfinite(w) and w >= 0.0 for w in ws) or abs(sum(ws) - 1.0) > 1e-9:
            raise ValueError(f"a teacher blend needs weights >= 0 that sum to 1, got {self}")

    @classmethod
    def ema(cls, rate: float) -> TeacherBlend:
        """theta_T <- (1 - rate) theta_T + rate theta_S."""
        return cls(policy=rate, teacher=1.0 - rate)

    @classmethod
    def copy(cls) -> TeacherBlend:
        """theta_T <- theta_S."""
        return cls(policy=1.0, teacher=0.0)

    @classmethod
    def init(cls, alpha: float) -> TeacherBlend:
        """theta_T <- alpha theta_T + (1 - alpha) theta_S: the teacher initialisation of the
        paper's code (`teacher_init_alpha`), applied once the teacher holds the checkpoint."""
        return cls(policy=1.0 - alpha, teacher=alpha)

    @classmethod
    def base(cls) -> TeacherBlend:
        """theta_T <- the base model."""
        return cls(teacher=0.0, reference=1.0)

    @property
    def is_identity(self) -> bool:
        return self.teacher == 1.0

    def weights(self) -> dict[str, float]:
        """The sources other than the teacher that this blend draws on, with their weights."""
        return {name: getattr(self, name) for name in SOURCES if getattr(self, name) > 0.0}


def _pairs(
    name_a: str, a: Iterable[torch.Tensor], name_b: str, b: Iterable[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    la, lb = list(a), list(b)
    if len(la) != len(lb):
        raise ValueError(f"{name_a} has {len(la)} tensors but {name_b} has {len(lb)}: the layouts differ")
    for k, (x, y) in enumerate(zip(la, lb, strict=True)):
        if x.shape != y.shape:
            raise ValueError(f"tensor {k}: {name_a} has shape {tuple(x.shape)} but {name_b} has {tuple(y.shape)}")
    return list(zip(la, lb, strict=True))


@torch.no_grad()
def blend_(
    teacher_params: Iterable[torch.Tensor], sources: Mapping[str, Iterable[torch.Tensor]], blend: TeacherBlend
) -> None:
    """In place, shard-local: teacher <- `blend` of the teacher and `sources` ({"policy": ...,
    "reference": ...}, each in the teacher's order and shapes; only those the blend draws on are
    read). Arithmetic in fp32, one rounding into the teacher's dtype; a pure copy is exact.

    With a small EMA rate bf16 rounding can swallow the update entirely: keep an fp32 teacher
    (or an fp32 shadow of it) when the rate is below ~1e-2."""
    weights = blend.weights()
    if not weights:
        return
    missing = [name for name in weights if name not in sources]
    if missing:
        raise ValueError(f"the blend {blend} draws on {missing} but only {sorted(sources)} were given")
    teacher = list(teacher_params)
    columns = {name: [s for _, s in _pairs("teacher_params", teacher, name, sources[name])] for name in weights}
    for k, t in enumerate(teacher):
        srcs = [(columns[name][k].to(torch.float32), w) for name, w in weights.items()]
        if blend.teacher == 0.0 and len(srcs) == 1:
            t.copy_(srcs[0][0])
            continue
        t32 = t if t.dtype == torch.float32 else t.to(torch.float32)
        if len(srcs) == 1:
            t32.lerp_(srcs[0][0], srcs[0][1])  # (1 - w) t + w s, as one fused op
        else:
            t32.mul_(blend.teacher)
            for s, w in srcs:
                t32.add_(s, alpha=w)
        if t32 is not t:
            t.copy_(t32)


@torch.no_grad()
def copy_(teacher_params: Iterable[torch.Tensor], student_params: Iterable[torch.Tensor]) -> None:
    """In place: teacher <- student (cast to the teacher's dtype)."""
    for t, s in _pairs("teacher_params", teacher_params, "student_params", student_params):
        t.copy_(s)
