"""Pure maths of the RL algorithms: no model, no distributed code.

grpo        group-relative advantages and the clipped policy-gradient loss
divergence  the generalized JSD: the one definition (kernels and backends call its pieces)
sdpo        token-level distillation losses, importance weights, CoT mask
context     the teacher re-prompt (successful sibling / feedback)
teacher     teacher weight updates (EMA, copy) and their schedule
losses      LossFn adapters that the backends call
"""
