"""The HF backend's teacher as one object: the model its forwards run, its fp32 truth, the
trust-region logit mix and the clock of its forwards.

State updated by small steps lives in fp32 whatever the model dtype: with a bf16/fp16 model the
EMA teacher is an fp32 shadow, rounded once into the model used for forwards after every update
(at an EMA rate of 0.05 most bf16 weights would otherwise never move). The megatron side keeps the
same pieces as its teacher module and `megatron/teacher_state.FP32TeacherShadow` (sharded there).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from megatron_sdpo.backends.checkpoint import load_hf_weights
from megatron_sdpo.interfaces.blend import TeacherBlend, blend_, copy_
from megatron_sdpo.stopwatch import Stopwatch


class HFTeacher:
    """`model`: a frozen copy of the policy. `logit_mix` (validated by the config, in [0, 1]):
    the trust-region teacher's logits are lerp(teacher, student, mix) on the teacher's input
    (lasgroup/SDPO TrustRegionTeacher); None: the teacher's own logits."""

    def __init__(self, model: nn.Module, device: torch.device, *, logit_mix: float | None = None):
        assert logit_mix is None or 0.0 <= logit_mix <= 1.0, logit_mix  # teacher.trust_region_mix, validated
        self.model = model
        self.logit_mix = logit_mix
        # Time in the teacher's forward inside train_step, reported as "time/teacher_forward".
        self.clock = Stopwatch(device)
        params = self.params()
        low_precision = any(p.dtype != torch.float32 for p in params)
        self.shadow: list[torch.Tensor] | None = (
            [p.to(torch.float32).clone() for p in params] if low_precision else None
        )

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]

    def fp32_weights(self) -> list[torch.Tensor]:
        """The teacher's fp32 truth in `parameters()` order: the shadow, else the parameters."""
        return self.shadow if self.shadow is not None else self.params()

    @torch.no_grad()
    def blend(self, blend: TeacherBlend, sources: dict) -> None:
        """teacher <- `blend` of itself and `sources` (interfaces/blend.py) in its fp32 truth,
        rounded once into the model when it runs in bf16/fp16."""
        blend_(self.fp32_weights(), sources, blend)
        if self.shadow is not None:
            copy_(self.params(), self.shadow)

    @torch.no_grad()
    def load(self, path: str | Path) -> None:
        """Teacher <- the weights of the HF model directory `path` (the student's layout)."""
        load_hf_weights(self.model, Path(path))
        self.resync()

    @torch.no_grad()
    def resync(self, fp32: list[torch.Tensor] | None = None) -> None:
        """The shadow <- `fp32` (a saved shadow) or the model's weights just loaded."""
        if self.shadow is not None:
            copy_(self.shadow, fp32 if fp32 is not None else self.params())
