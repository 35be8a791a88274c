"""Vocab-parallel plumbing: shard offsets and the per-token statistic exchanges.

Megatron splits the LM head into equal contiguous row blocks (``VocabUtility``): rank r of a
tensor-parallel group of size P owns ids ``[r * V/P, (r + 1) * V/P)``. Every collective sends a
contiguous fp32 buffer (gloo silently mishandles non-contiguous views).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """World size of ``group`` (1 when ``group`` is None or torch.distributed is not initialized)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def vocab_start(group, local_vocab: int) -> int:
    """First global token id of this rank's shard."""
    if group_size(group) == 1:
        return 0
    return dist.get_rank(group) * local_vocab


def gather_stats(local: torch.Tensor, group) -> torch.Tensor:
    """All-gather a packed ``[k, N]`` statistic block into ``[P, k, N]`` (rank order).

    Max and sum cannot share one all-reduce op; gathering the few floats per token once and
    combining them locally in rank order costs P*k*N floats and gives every rank the same bits.
    """
    p = group_size(group)
    if p == 1:
        return local.unsqueeze(0)
    local = local.contiguous()
    out = [torch.empty_like(local) for _ in range(p)]
    dist.all_gather(out, local, group=group)
    return torch.stack(out)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over the group (returns a new contiguous tensor; identity at size 1)."""
    if group_size(group) == 1:
        return t
    t = t.contiguous().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def combine_lse(gathered: torch.Tensor) -> torch.Tensor:
    """``[P, k, N]`` per-rank log-sum-exps -> ``[k, N]`` global log-sum-exps."""
    return torch.logsumexp(gathered, dim=0)


def combine_lp_stats(gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[P, 4, N]`` (max, sumexp, sum exp*z, label logit) -> (lse, mean logit under p, label logit)."""
    m_r, s_r, u_r, zl_r = gathered.unbind(1)
    m = m_r.amax(dim=0)
    scale = torch.exp(m_r - m.unsqueeze(0))
    s = (s_r * scale).sum(0)
    u = (u_r * scale).sum(0)
    return m + torch.log(s), u / s, zl_r.sum(0)
