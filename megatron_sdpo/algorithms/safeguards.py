"""Two safeguards of SDPO's distillation, as weights on its token mask (off by default).

The SmolLM2 study (docs/findings.md) found SDPO₀ losing math out-of-distribution accuracy where
GRPO gains it. A plausible mechanism: the teacher, shown a successful sibling, pulls every
sample towards the sibling's form token by token, also in groups where every sample already
succeeded (GRPO's advantage is 0 there) and on tokens where the teacher's preference disagrees
with the sample's outcome. Each safeguard removes one of these:

- **contrast gate** (`algorithm.sdpo.contrast_gate = s0`): a prompt's distillation weight is
  min(1, std(group rewards) / s0), the std the unbiased one GRPO's advantages use; s0 = 0 is the
  binary gate (1 where the group's rewards differ at all, else 0). No contrast, no distillation,
  as in GRPO.
- **advantage-agreement mask** (`algorithm.sdpo.agreement_mask`): a token keeps its distillation
  only where the teacher's log-ratio over the student on the sampled token,
  log pi_T(y_t | context) - log pi_S(y_t), has the sign of the sample's group-relative advantage
  r - mean(group); a sample whose advantage is 0 drops out.

Both act on the mask the loss already reads, so every backend and loss path (full vocabulary,
top-k, fused kernel, sampled) takes them unchanged, the loss's normalizer counts the weighted
tokens, and a row left without weight leaves the step (`skip_zero_signal`).
"""

from __future__ import annotations

import torch

from megatron_sdpo.algorithms.grpo import group_advantages
from megatron_sdpo.errors import ConfigError


def contrast_weights(rewards: torch.Tensor, *, group_size: int, s0: float) -> torch.Tensor:
    """[G*n] rewards (a group's n samples consecutive) -> [G*n] fp32 weight of each sample's
    distillation: min(1, std / s0) of its group (s0 = 0: 1 where std > 0, else 0)."""
    if s0 < 0:
        raise ConfigError(f"algorithm.sdpo.contrast_gate must be >= 0 (0: the binary gate), got {s0:g}")
    groups = rewards.to(torch.float32).view(-1, group_size)
    # Equal rewards give a std of exactly 0 only up to round-off of the mean: test the spread
    # (a group of one sample has none: weight 0, as its GRPO advantage).
    w = (groups.amax(dim=1) > groups.amin(dim=1)).to(torch.float32)
    if s0 > 0 and group_size > 1:
        w = w * torch.clamp(groups.std(dim=1, unbiased=True) / s0, max=1.0)
    return w.repeat_interleave(group_size)


def agreement_mask(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, rewards: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """[B, T] fp32 1 where sign(teacher - student log-prob of the sampled token) equals the sign
    of the sample's group-relative advantage (0 on a zero advantage or a zero log-ratio)."""
    if teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(
            f"teacher {tuple(teacher_logprobs.shape)} and student {tuple(student_logprobs.shape)} "
            "log-probs differ in shape"
        )
    adv = group_advantages(rewards.to(torch.float32), group_size=group_size, norm_by_std=False)
    ratio = teacher_logprobs.to(torch.float32) - student_logprobs.to(torch.float32)
    agree = (torch.sign(ratio) == torch.sign(adv)[:, None]) & (adv != 0)[:, None]
    return agree.to(torch.float32)
