"""Rewards scored once across the launch: each rank scores its contiguous share of a batch every
rank holds (the same completions and records), and the results are gathered to every rank.

Before, every rank scored the whole batch: at 16 ranks the code sandbox ran each program 16
times. The gather is an object gather on a gloo group (on GPU launches, a gloo group over the
world made once: small pickled results need no trip through device memory).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_sdpo.rollout.replicas import share_bounds

_GLOO: dict[str, dist.ProcessGroup | None] = {}


def object_group() -> dist.ProcessGroup | None:
    """The group object gathers of the run use: the world itself when it runs on gloo, else a
    gloo group over the world, created on first use (every rank reaches it together)."""
    if "world" not in _GLOO:
        _GLOO["world"] = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _GLOO["world"]


def score_shared(domain: str, texts: list[str], records: list[dict], *, batched_code: bool) -> list:
    """rewards.score_batch(domain, texts, records) on every rank, each item scored on one rank."""
    from megatron_sdpo import rewards

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return rewards.score_batch(domain, texts, records, batched_code=batched_code)
    start, end = share_bounds(len(texts), dist.get_world_size())[dist.get_rank()]
    mine = rewards.score_batch(domain, texts[start:end], records[start:end], batched_code=batched_code)
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine, group=object_group())
    return [r for share in shares for r in share]
