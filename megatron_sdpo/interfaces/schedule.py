"""Learning-rate schedule shared by both backends: linear warmup, then constant / linear /
cosine decay to `min_lr_ratio * lr`, restarted at every stage (each stage is a new task with a
fresh optimizer by default).

The semantics are megatron-core's `OptimizerParamScheduler` (init lr 0): the Megatron backend
uses that class itself, the HF backend this function, and a test holds the two equal.
Step k is the number of optimizer steps already taken in the stage; with warmup the first step
runs at lr 0, as in megatron, verl and transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sdpo.errors import ConfigError

STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """style: "constant" | "linear" | "cosine"; warmup_steps >= 0; min_lr_ratio in [0, 1]."""

    style: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def check(self, total_steps: int | None = None) -> None:
        """ConfigError when the schedule is malformed or cannot fit `total_steps`."""
        if self.style not in STYLES:
            raise ConfigError(f"lr_schedule.style={self.style!r}; expected one of {STYLES}")
        if self.warmup_steps < 0:
            raise ConfigError(f"lr_schedule.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"lr_schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if total_steps is not None and total_steps > 0 and self.warmup_steps >= total_steps:
            raise ConfigError(
                f"lr_schedule.warmup_steps={self.warmup_steps} must be smaller than the stage's {total_steps} steps"
            )

    def lr(self, step: int, total_steps: int | None, peak: float) -> float:
        """The learning rate for the optimizer step that follows `step` completed steps of a
        stage of `total_steps` (None: the stage length is unknown, the peak is held)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return peak * step / self.warmup_steps
        if self.style == "constant" or total_steps is None:
            return peak
        low = peak * self.min_lr_ratio
        if step > total_steps:
            return low
        ratio = (step - self.warmup_steps) / (total_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return low + coeff * (peak - low)
