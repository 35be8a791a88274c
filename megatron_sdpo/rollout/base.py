"""The rollout seam: sample n responses per prompt, with the sampler's own logprobs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# What an engine's sleep releases, in the order the trainer brings them back around a refit.
WAKE_TAGS = ("weights", "kv_cache")
# What the refit may take of the device memory free when it starts (NeMo-RL sizes its refit
# buffer at 30% of the memory free after offloading the trainer): vllm.py applies it, the memory
# ledger (planning/memory_ledger.py) plans with it.
REFIT_FREE_SHARE = 0.3


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


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Runs the block with `threads` torch intra-op threads (None: leave the count alone) and
    restores the count after. Decoding is a long chain of small ops: on a busy CPU, OpenMP
    workers spin-waiting at every op's barrier can cost more than a second thread gains."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RolloutEngine(Protocol):
    """What the trainer and the refit guard need from an engine. Engines subclass it to declare
    conformance; a conformance test checks that each defines every member itself.

    `last_sync`: metrics of the last `update_weights` (timings; {} where the engine reports
    none). `sent_checksums` / `received_checksums`: per-tensor checksums of what the trainer sent
    at the last refit and of what the engine's worker received ({} where the weights never leave
    the process); the refit guard compares them."""

    last_sync: dict[str, float]
    sent_checksums: dict[str, tuple[float, float]]
    received_checksums: dict[str, tuple[float, float]]

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped consecutively: prompt 0's n, then prompt 1's, ..."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors in place (streamed, bucketed by the engine)."""

    def sleep(self) -> None:
        """Release accelerator memory while the trainer runs (no-op where unsupported)."""

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire what sleep() released: `tags` of WAKE_TAGS, None for all. A refit needs
        "weights" awake, a generation both."""
