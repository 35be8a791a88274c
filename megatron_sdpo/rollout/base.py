"""The rollout seam: sample n responses per prompt, with the sampler's own logprobs; and what
both engines share (sampling checks, EOS ids, the tokenizer), so that neither imports the other."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megatron_sdpo.errors import ConfigError

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


def check_sampling(sampling: SamplingConfig) -> None:
    """One-line ConfigError for invalid sampling parameters."""
    if sampling.n < 1:
        raise ConfigError(f"sampling.n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if not sampling.greedy and sampling.temperature <= 0:
        raise ConfigError(f"sampling.temperature must be > 0 (use greedy=True), got {sampling.temperature}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ConfigError(f"sampling.top_p must be in (0, 1], got {sampling.top_p}")


def eos_ids_of(model_path: str) -> list[int]:
    """EOS ids from generation_config.json (preferred) or config.json of a HF model dir."""
    for fname in ("generation_config.json", "config.json"):
        f = Path(model_path, fname)
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def load_tokenizer(model_path: str):
    """AutoTokenizer of `model_path`, or ConfigError saying detokenize needs one."""
    from transformers import AutoTokenizer

    # transformers 5 builds an empty tokenizer (vocab of 1) for a directory without tokenizer
    # files instead of failing: check for the files first.
    if not any(Path(model_path, f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ConfigError(
            f"detokenize=True needs a tokenizer in {model_path} (no tokenizer files found); "
            "pass detokenize=False to return token ids only"
        )
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # transformers raises many types for a missing tokenizer
        raise ConfigError(
            f"detokenize=True needs a tokenizer in {model_path} ({type(exc).__name__}); "
            "pass detokenize=False to return token ids only"
        ) from None
