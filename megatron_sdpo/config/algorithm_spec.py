"""What each `algorithm.name` means to the rest of the system, as one typed table.

Code asks the spec (does this algorithm need a teacher? advantages? which mask does the
distillation read?) instead of comparing names, so a new algorithm is one row here. The table
lives in config/ because config validation reads it and config imports nothing above itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sdpo.errors import ConfigError


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    # A teacher model (second weight set) scores the student's responses: self-distillation.
    uses_teacher: bool
    # Group-relative advantages feed a policy-gradient term.
    uses_advantages: bool
    # Batch tensor that masks the distilled tokens; None without distillation. The hybrid keeps
    # `loss_mask` for its GRPO term and distils only under `sdpo_mask`.
    distill_mask_key: str | None
    # Several optimizer steps per rollout batch (algorithm.grpo.mini_batches > 1).
    supports_mini_batches: bool
    # teacher.mode the algorithm is defined with: `compare` sets it, validation requires it
    # where `requires_teacher_mode`; None: the config's own teacher.mode.
    teacher_mode: str | None = None
    requires_teacher_mode: bool = False


ALGORITHMS: dict[str, AlgorithmSpec] = {
    s.name: s
    for s in (
        AlgorithmSpec(
            "grpo", uses_teacher=False, uses_advantages=True, distill_mask_key=None, supports_mini_batches=True
        ),
        AlgorithmSpec(
            "sdpo",
            uses_teacher=True,
            uses_advantages=False,
            distill_mask_key="loss_mask",
            supports_mini_batches=False,
            teacher_mode="ema",
        ),
        AlgorithmSpec(
            "stable_sdpo",
            uses_teacher=True,
            uses_advantages=False,
            distill_mask_key="loss_mask",
            supports_mini_batches=False,
            teacher_mode="restart_freeze",
            requires_teacher_mode=True,
        ),
        AlgorithmSpec(
            "hybrid", uses_teacher=True, uses_advantages=True, distill_mask_key="sdpo_mask", supports_mini_batches=False
        ),
    )
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The spec of `algorithm.name`; ConfigError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}") from None
