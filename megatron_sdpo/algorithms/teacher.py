"""When to update the teacher, and how.

The teacher is a second weight set with the student's layout. Every teacher update is a
`TeacherBlend` (interfaces/blend.py): the new teacher as a convex combination of the policy
(student), the current teacher and the reference (the base model), which each backend applies
shard by shard with its `blend_teacher`.

Schedules (`TeacherController`) decide which blend to apply when:
- "ema": theta_T <- (1 - r) theta_T + r theta_S after every optimizer step (r = 0.05 is "fast";
  the continual-learning study finds it collapses).
- "frozen": the teacher is the student as it was at the start of the stage.
- "restart_freeze" (StableSDPO): copy the student into the teacher at the stage start and then
  every ceil(gamma * stage_steps) steps; frozen in between (gamma = 0.4 was best).
- "trust_region": the weights as "frozen"; the backend mixes the teacher's logits with the
  live student's (lasgroup's trust-region teacher), which no weight blend expresses.
With a teacher initialisation (`teacher.init_path`) the backend builds the teacher from the
checkpoint and the run's first stage start keeps it instead of copying the student.

A new teacher variant is a new schedule here (and its config keys): the backends only know how
to apply a blend.
"""

from __future__ import annotations

import math

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.blend import TeacherBlend


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

    Its decisions are `TeacherBlend`s; the backend's `blend_teacher(blend)` applies them. The
    settings are validated with the config (config/validation.py), not here.
    """

    def __init__(
        self,
        mode: str,
        ema_rate: float = 0.05,
        freeze_fraction: float = 0.4,
        stage_steps: int = 1,
        *,
        reset_at_stage: str = "none",
        init_teacher: bool = False,
    ) -> None:
        self.mode = mode
        self.init_teacher = bool(init_teacher)
        self.configure(ema_rate=ema_rate, freeze_fraction=freeze_fraction, reset_at_stage=reset_at_stage)
        self.stage_steps = self._check_steps(stage_steps)
        self.stage_index = -1  # no stage started yet
        self.step = 0  # optimizer steps completed in the current stage
        self.num_copies = 0

    def configure(self, *, ema_rate: float, freeze_fraction: float, reset_at_stage: str) -> None:
        """Set the schedule's settings (a stage may change them: config/stages.py)."""
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

    def on_stage_start(self, stage_steps: int | None = None) -> TeacherBlend:
        """Call before the first step of a stage; returns the blend to apply now."""
        if stage_steps is not None:
            self.stage_steps = self._check_steps(stage_steps)
        first = self.stage_index < 0
        self.stage_index += 1
        self.step = 0
        if not first and self.reset_at_stage == "base":
            return TeacherBlend.base()
        if first and self.init_teacher:
            return TeacherBlend()  # the backend built the teacher from its initialisation
        if self.mode == "ema" and not (first or self.reset_at_stage == "stage_start"):
            return TeacherBlend()
        self.num_copies += 1
        return TeacherBlend.copy()

    def after_step(self, step: int) -> TeacherBlend:
        """Call after optimizer step `step` (1-based, counted within the stage); returns the blend.

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
            return TeacherBlend.ema(self.ema_rate)
        if self.mode in ("frozen", "trust_region"):
            return TeacherBlend()
        if step % self.restart_period == 0 and step < self.stage_steps:
            self.num_copies += 1
            return TeacherBlend.copy()
        return TeacherBlend()

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
