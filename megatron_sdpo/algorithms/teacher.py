"""Teacher weights and when to update them.

The teacher is a second weight set with the student's layout. The update functions work on
parameter iterables shard by shard (each rank passes its local shards of both models in the same
order), so any backend -- plain torch, DDP, Megatron TP/PP -- uses them with no communication.

Schedules (`TeacherController`):
- "ema": theta_T <- (1 - r) theta_T + r theta_S after every optimizer step (r = 0.05 is "fast";
  the continual-learning study finds it collapses).
- "frozen": the teacher is the student as it was at the start of the stage.
- "restart_freeze" (StableSDPO): copy the student into the teacher at the stage start and then
  every ceil(gamma * stage_steps) steps; frozen in between (gamma = 0.4 was best).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from megatron_sdpo.errors import ConfigError

MODES = ("ema", "frozen", "restart_freeze")
RESETS = ("none", "base", "stage_start")


def _pairs(name_a: str, a: Iterable[torch.Tensor], name_b: str, b: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    la, lb = list(a), list(b)
    if len(la) != len(lb):
        raise ValueError(f"{name_a} has {len(la)} tensors but {name_b} has {len(lb)}: the layouts differ")
    for k, (x, y) in enumerate(zip(la, lb)):
        if x.shape != y.shape:
            raise ValueError(f"tensor {k}: {name_a} has shape {tuple(x.shape)} but {name_b} has {tuple(y.shape)}")
    return list(zip(la, lb))


def _check_rate(name: str, rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"{name} must be in [0, 1], got {rate}")


@torch.no_grad()
def ema_update_(teacher_params: Iterable[torch.Tensor], student_params: Iterable[torch.Tensor], rate: float) -> None:
    """In place: teacher <- (1 - rate) * teacher + rate * student, computed in fp32.

    A bf16 teacher is updated through an fp32 copy and rounded once; note that with small rates
    bf16 rounding can swallow the update entirely, so keep an fp32 teacher (or fp32 master copy)
    when the rate is below ~1e-2.
    """
    _check_rate("ema rate", rate)
    for t, s in _pairs("teacher_params", teacher_params, "student_params", student_params):
        if t.dtype == torch.float32:
            t.lerp_(s.to(torch.float32), rate)
        else:
            t32 = t.to(torch.float32)
            t32.lerp_(s.to(torch.float32), rate)
            t.copy_(t32)


@torch.no_grad()
def copy_(teacher_params: Iterable[torch.Tensor], student_params: Iterable[torch.Tensor]) -> None:
    """In place: teacher <- student (cast to the teacher's dtype)."""
    for t, s in _pairs("teacher_params", teacher_params, "student_params", student_params):
        t.copy_(s)


def apply_action_(
    action: str, teacher_params: Iterable[torch.Tensor], student_params: Iterable[torch.Tensor], *, rate: float = 0.0
) -> None:
    """Perform a TeacherController action in place: "ema" (rate), "copy" (student -> teacher) or
    "none". Shard-local, so every backend calls it on its own parameter shards."""
    if action == "none":
        return
    if action == "ema":
        ema_update_(teacher_params, student_params, rate)
    elif action == "copy":
        copy_(teacher_params, student_params)
    else:
        raise ConfigError(f"teacher action must be 'ema', 'copy' or 'none', got {action!r}")


class TeacherController:
    """Decides the teacher action at stage starts and after each optimizer step.

    Args:
        mode: "ema" | "frozen" | "restart_freeze".
        ema_rate: the EMA rate r (mode "ema"), in (0, 1].
        freeze_fraction: gamma in (0, 1] (mode "restart_freeze"): fraction of the stage's steps
            the teacher stays frozen between restarts.
        stage_steps: optimizer steps per stage (can be overridden per stage in on_stage_start).
        reset_at_stage: at every stage start after the first: "none" keeps an EMA teacher (the
            frozen and restart_freeze teachers copy the student there by definition),
            "stage_start" copies the student, "base" loads the base model into the teacher.
            The first stage always starts with a copy.

    Actions are "none", "copy" (student -> teacher), "ema" (apply `ema_update_` with
    `ema_rate`) and "base" (base model -> teacher); the backend's
    `teacher_update(action, rate=...)` performs them.
    """

    def __init__(
        self,
        mode: str,
        ema_rate: float = 0.05,
        freeze_fraction: float = 0.4,
        stage_steps: int = 1,
        *,
        reset_at_stage: str = "none",
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"teacher mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.configure(ema_rate=ema_rate, freeze_fraction=freeze_fraction, reset_at_stage=reset_at_stage)
        self.stage_steps = self._check_steps(stage_steps)
        self.stage_index = -1  # no stage started yet
        self.step = 0  # optimizer steps completed in the current stage
        self.num_copies = 0

    def configure(self, *, ema_rate: float, freeze_fraction: float, reset_at_stage: str) -> None:
        """Set the schedule's settings (a stage may change them: config/stages.py)."""
        if self.mode == "ema" and not 0.0 < ema_rate <= 1.0:
            raise ConfigError(f"teacher.ema_rate must be in (0, 1] for mode 'ema', got {ema_rate}")
        if self.mode == "restart_freeze" and not 0.0 < freeze_fraction <= 1.0:
            raise ConfigError(f"teacher.freeze_fraction must be in (0, 1], got {freeze_fraction}")
        if reset_at_stage not in RESETS:
            raise ConfigError(f"teacher.reset_at_stage must be one of {', '.join(RESETS)}, got {reset_at_stage!r}")
        self.ema_rate = float(ema_rate)
        self.freeze_fraction = float(freeze_fraction)
        self.reset_at_stage = reset_at_stage

    @staticmethod
    def _check_steps(stage_steps: int) -> int:
        if isinstance(stage_steps, bool) or not isinstance(stage_steps, int) or stage_steps < 1:
            raise ConfigError(f"stage_steps must be a positive integer, got {stage_steps!r}")
        return stage_steps

    @property
    def restart_period(self) -> int:
        """Steps between restarts in mode "restart_freeze": ceil(freeze_fraction * stage_steps)."""
        # round() first so that 0.4 * 100 = 40.000000000000004 does not become 41.
        return max(1, math.ceil(round(self.freeze_fraction * self.stage_steps, 9)))

    def on_stage_start(self, stage_steps: int | None = None) -> str:
        """Call before the first step of a stage; returns the action to apply now."""
        if stage_steps is not None:
            self.stage_steps = self._check_steps(stage_steps)
        first = self.stage_index < 0
        self.stage_index += 1
        self.step = 0
        if not first and self.reset_at_stage == "base":
            return "base"
        if self.mode == "ema" and not (first or self.reset_at_stage == "stage_start"):
            return "none"
        self.num_copies += 1
        return "copy"

    def after_step(self, step: int) -> str:
        """Call after optimizer step `step` (1-based, counted within the stage); returns the action.

        restart_freeze copies at multiples of the restart period, except at the stage's last step
        (the next stage starts with a copy anyway, and the stage's checkpoint keeps the teacher it
        trained with).
        """
        if self.stage_index < 0:
            raise RuntimeError("TeacherController.after_step called before on_stage_start")
        if isinstance(step, bool) or not isinstance(step, int) or step != self.step + 1:
            raise ValueError(f"after_step expected step {self.step + 1} of the stage, got {step!r}")
        self.step = step
        if self.mode == "ema":
            return "ema"
        if self.mode == "frozen":
            return "none"
        if step % self.restart_period == 0 and step < self.stage_steps:
            self.num_copies += 1
            return "copy"
        return "none"

    def state_dict(self) -> dict:
        """Everything needed to resume the schedule mid-stage."""
        return {
            "mode": self.mode,
            "ema_rate": self.ema_rate,
            "freeze_fraction": self.freeze_fraction,
            "reset_at_stage": self.reset_at_stage,
            "stage_steps": self.stage_steps,
            "stage_index": self.stage_index,
            "step": self.step,
            "num_copies": self.num_copies,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by `state_dict`; the schedule settings must match."""
        for key in ("mode", "ema_rate", "freeze_fraction", "reset_at_stage"):
            if key not in state:
                raise ConfigError(f"teacher controller state lacks {key!r}")
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"teacher.{key} is {getattr(self, key)!r} in the config but {state[key]!r} in the "
                    f"checkpoint; resume with the same teacher settings"
                )
        self.stage_steps = self._check_steps(int(state["stage_steps"]))
        self.stage_index = int(state["stage_index"])
        self.step = int(state["step"])
        self.num_copies = int(state["num_copies"])
