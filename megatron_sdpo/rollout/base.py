"""The rollout seam: sample n responses per prompt, with the sampler's own logprobs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch


@dataclass
class SamplingConfig:
    """Sampling parameters shared by every engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    greedy: bool = False
    seed: int | None = None  # per-call seed: the same seed gives the same samples (resume)


@dataclass
class Completion:
    """One sampled response: token ids (EOS included when generated), per-token sampling
    logprobs (fp32, same length), decoded text, and whether it stopped at max length."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    truncated: bool


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped consecutively: prompt 0's n, then prompt 1's, ..."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors in place (streamed, bucketed by the engine)."""

    def sleep(self) -> None:
        """Release accelerator memory while the trainer runs (no-op where unsupported)."""

    def wake(self) -> None:
        """Re-acquire memory before the next generation."""
