"""Per-token statistics of vocab-sharded logits: logprob, entropy, generalized JSD.

Rank r of the TP group holds logits for global ids [start, start + width), where `width`
already excludes the padded vocabulary rows (the last rank's shard is cut at the real vocab
size instead of masking the pads to -inf, which would give 0 * -inf = NaN in entropies/KLs).
Only per-token scalars cross ranks: a max (no gradient) and sums. Never a full-vocabulary
gather; fp32 throughout.

Gradients through the all-reduces: a sum whose result feeds *replicated* computations (the same
value on every rank, e.g. logprob = target logit - lse) has an identity backward, as in
megatron's vocab-parallel cross entropy. A normalizer that feeds *rank-partial* terms (each rank
sums its own vocabulary slice of p*log p or of a KL, and those partial sums are added later)
receives only this rank's share of dL/dlse, so its backward must all-reduce the gradient.
Each statistic therefore computes its own log-normalizer in the right mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sdpo.algorithms.divergence import combine_jsd_parts, jsd_part_sums


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward; identity in backward (the result is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _AllReduceSumSharedGrad(torch.autograd.Function):
    """Sum over the group in forward and in backward (consumers are rank-partial)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; at 1.0 the logits themselves: x / 1.0 is x to the bit, and the copy
    would be one more fp32 [tokens, vocab / TP] tensor alive through the loss's backward."""
    return logits if temperature == 1.0 else logits / temperature


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum over `group` (identity for a group of one)."""
    return x if _size(group) == 1 else _AllReduceSum.apply(x, group)


def _global_max(x: torch.Tensor, group) -> torch.Tensor:
    m = x.detach().amax(dim=-1)
    if _size(group) > 1:
        m = m.contiguous()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return m


def log_normalizer(logits: torch.Tensor, group, *, partial_consumers: bool = False) -> torch.Tensor:
    """[..., Vr] local fp32 logits -> [...] global log-sum-exp (differentiable).

    partial_consumers: the result feeds per-rank vocabulary-slice terms (see module doc)."""
    m = _global_max(logits, group)
    s = torch.exp(logits - m.unsqueeze(-1)).sum(-1)
    if _size(group) > 1:
        s = (_AllReduceSumSharedGrad if partial_consumers else _AllReduceSum).apply(s, group)
    return m + torch.log(s)


def logprobs(logits: torch.Tensor, targets: torch.Tensor, start: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of `targets` and the log-normalizer.

    logits: [..., Vr] fp32 shard for ids [start, start + Vr); targets: [...] global ids.
    Returns (logprobs [...], lse [...]), both differentiable w.r.t. `logits`."""
    lse = log_normalizer(logits, group)
    local = targets - start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = all_reduce_sum(torch.where(inside, picked, torch.zeros_like(picked)), group)
    return target_logit - lse, lse


def entropy(logits: torch.Tensor, group) -> torch.Tensor:
    """[..., Vr] shard -> [...] entropy of the full distribution."""
    logp = logits - log_normalizer(logits, group, partial_consumers=True).unsqueeze(-1)
    return -all_reduce_sum((logp.exp() * logp).sum(-1), group)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, alpha: float, group) -> torch.Tensor:
    """Per-token generalized JSD (`megatron_sdpo.algorithms.divergence`) between full-vocabulary
    distributions from shards: each rank sums its shard's share of the two KL parts, combined
    with the mixture weights before one all-reduce (the combination is linear).

    student, teacher: [..., Vr] fp32 logit shards (teacher without grad). Returns [...]."""
    logp_s = student - log_normalizer(student, group, partial_consumers=True).unsqueeze(-1)
    logp_t = teacher - log_normalizer(teacher.detach(), group, partial_consumers=True).unsqueeze(-1)
    local = combine_jsd_parts(*jsd_part_sums(logp_s, logp_t, alpha), alpha)
    return all_reduce_sum(local, group)


def _pick(logits: torch.Tensor, ids: torch.Tensor, start: int, group) -> torch.Tensor:
    """[..., Vr] shard, [..., k] global ids -> [..., k] logits at those ids, summed over the
    group (each id lives on exactly one rank; identity backward, the result is replicated)."""
    local = ids - start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1))
    return all_reduce_sum(torch.where(inside, picked, torch.zeros_like(picked)), group)


def topk_logprobs(
    student: torch.Tensor, teacher: torch.Tensor, k: int, start: int, vocab: int, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-probabilities of the student's k most likely ids, from shards.

    student, teacher: [..., Vr] fp32 shards for ids [start, start + Vr) (teacher without grad);
    vocab: the real vocabulary size (k must not exceed it). Each rank proposes its local top-k
    (padded with -inf where its shard is narrower than k, never chosen since the vocabulary
    holds k finite logits); the [..., tp * k] candidates (values and global ids, no gradient)
    are all-gathered in rank order and every rank keeps the same global top-k.
    Returns (student logprobs [..., k] differentiable, teacher logprobs [..., k], ids [..., k]).
    """
    if not 1 <= k <= vocab:
        raise ValueError(f"topk={k} must be in [1, vocabulary size {vocab}]")
    kk = min(k, student.shape[-1])
    vals, idx = student.detach().topk(kk, dim=-1)
    ids = idx + start
    if kk < k:
        pad = (*vals.shape[:-1], k - kk)
        vals = torch.cat([vals, vals.new_full(pad, float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_full(pad, start)], dim=-1)
    n = _size(group)
    if n > 1:
        cands = []
        for t in (vals, ids):
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t.contiguous(), group=group)
            cands.append(torch.cat(parts, dim=-1))
        vals, ids = cands
    ids = ids.gather(-1, vals.topk(k, dim=-1).indices)
    lse_s = log_normalizer(student, group)
    lse_t = log_normalizer(teacher.detach(), group)
    top_s = _pick(student, ids, start, group) - lse_s.unsqueeze(-1)
    top_t = _pick(teacher.detach(), ids, start, group) - lse_t.unsqueeze(-1)
    return top_s, top_t, ids


def shard_bounds(padded_vocab: int, vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """(start, width) of rank's real-vocabulary columns within its equal shard of the padded
    vocabulary (width may be smaller on the last ranks, never negative)."""
    per = padded_vocab // tp
    start = rank * per
    return start, max(0, min(per, vocab - start))
