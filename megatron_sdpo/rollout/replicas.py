"""Rollout replicas across the ranks of a launch: who generates which prompts, and the gather.

Under torchrun every rank hosts its part of one vLLM engine; `world / tp` engines (replicas)
each hold a full copy of the policy over `tp` consecutive ranks (vLLM's own placement: replica =
RANK // tp). A step's prompts are cut into contiguous, near-equal shares, one per replica; a
prompt's n samples stay on its replica (whole groups). Each replica generates its share, and the
completions are all-gathered in replica order, so every rank ends with the batch a single
process would produce, in the same order; the trainer then takes its data-parallel slice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megatron_sdpo.errors import ConfigError
from megatron_sdpo.rollout.base import Completion, RolloutEngine, SamplingConfig


@dataclass(frozen=True)
class ReplicaLayout:
    """world ranks = replicas x tp; this rank belongs to replica `rank // tp`."""

    world: int
    tp: int
    rank: int

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {self.tp}")
        if self.world % self.tp:
            raise ConfigError(f"rollout.tensor_parallel_size={self.tp} must divide the number of ranks ({self.world})")

    @classmethod
    def of_launch(cls, tp: int) -> ReplicaLayout:
        """The layout of this process in the torchrun / srun launch (world 1 outside one)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and tp > 1:
            raise ConfigError(
                f"rollout.tensor_parallel_size={tp} needs a launch of at least {tp} ranks (torchrun); "
                "a single process hosts one engine with tensor_parallel_size=1"
            )
        return cls(world=world, tp=tp, rank=int(os.environ.get("RANK", "0")))

    @property
    def replicas(self) -> int:
        return self.world // self.tp

    @property
    def replica(self) -> int:
        return self.rank // self.tp


def share_bounds(n_prompts: int, replicas: int) -> list[tuple[int, int]]:
    """[start, end) of each replica's contiguous share of `n_prompts` prompts: sizes differ by
    at most one, the first `n_prompts % replicas` shares take the extra prompt."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    base, extra = divmod(n_prompts, replicas)
    bounds, start = [], 0
    for r in range(replicas):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def merge_shares(shares: list[list[Completion]], bounds: list[tuple[int, int]]) -> list[Completion]:
    """Replica-ordered completion lists (prompt_index local to each share) -> one list with
    global prompt indices, in the order a single process returns them."""
    if len(shares) != len(bounds):
        raise ValueError(f"{len(shares)} shares for {len(bounds)} replicas")
    out: list[Completion] = []
    for comps, (start, end) in zip(shares, bounds, strict=True):
        for c in comps:
            if not 0 <= c.prompt_index < end - start:
                raise ValueError(f"completion of prompt {c.prompt_index} outside its share [0, {end - start})")
            out.append(Completion(c.prompt_index + start, c.token_ids, c.logprobs, c.text, c.truncated))
    return out


class ReplicatedRollout(RolloutEngine):
    """A rollout engine spread over the launch: splits each call's prompts by replica, generates
    this replica's share with `engine`, and all-gathers the completions (every rank of the world
    must call `generate` together, as vLLM's replicas step in lockstep anyway).

    Weight updates, sleep and wake go to this rank's part of its replica's engine unchanged."""

    def __init__(self, engine, layout: ReplicaLayout, group: dist.ProcessGroup | None = None):
        self.engine = engine
        self.layout = layout
        self.group = group

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped consecutively, for all of `prompt_ids` (the same
        list on every rank), on every rank."""
        bounds = share_bounds(len(prompt_ids), self.layout.replicas)
        start, end = bounds[self.layout.replica]
        # An empty share still calls generate: vLLM's replicas step together (dummy batches).
        mine = self.engine.generate(prompt_ids[start:end], sampling, first_index=start)
        gathered: list = [None] * self.layout.world
        # Completions are small Python objects (token ids, floats): an object gather is enough.
        dist.all_gather_object(gathered, mine, group=self.group)
        # Every rank of a replica returns the same completions; take the first rank's.
        shares = [gathered[r * self.layout.tp] for r in range(self.layout.replicas)]
        return merge_shares(shares, bounds)

    def update_weights(self, named_tensors) -> None:
        self.engine.update_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake(tags)

    # Sync timings and checksums live on the wrapped engine.
    @property
    def last_sync(self) -> dict[str, float]:
        return self.engine.last_sync

    @last_sync.setter
    def last_sync(self, value: dict[str, float]) -> None:
        self.engine.last_sync = value

    @property
    def sent_checksums(self) -> dict[str, tuple[float, float]]:
        return self.engine.sent_checksums

    @sent_checksums.setter
    def sent_checksums(self, value: dict[str, tuple[float, float]]) -> None:
        self.engine.sent_checksums = value

    @property
    def received_checksums(self) -> dict[str, tuple[float, float]]:
        return self.engine.received_checksums

    @received_checksums.setter
    def received_checksums(self, value: dict[str, tuple[float, float]]) -> None:
        self.engine.received_checksums = value
