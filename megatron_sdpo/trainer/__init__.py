"""The trainer: one on-policy RL step through a backend and a rollout engine.

step.py the step (rollout, rewards, advantages, update, refit) and the hooks it asks of the
loop; update.py the optimizer step(s) on one rollout batch; teacher.py SDPO's teacher inside a
step (contexts, distillation mask, safeguards, the teacher-signal diagnostics).
"""

from megatron_sdpo.trainer.step import StepHooks, StepOutput, Trainer, extra_round_seed, pad_2d
from megatron_sdpo.trainer.update import minibatch_update

__all__ = ["StepHooks", "StepOutput", "Trainer", "extra_round_seed", "minibatch_update", "pad_2d"]
