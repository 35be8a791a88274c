"""Token layout shared by the trainer and the HF rollout engine.

Prompts are left-padded to a common length P and responses right-padded to T, so response
token j of every sample sits at column P + j and is predicted by the logits at column P + j - 1.
With left padding the position of a token is its index among the *real* tokens of its row, so
position ids come from the attention mask, never from the column index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sdpo.errors import DataError


@dataclass
class PackedBatch:
    """input_ids / attention_mask / position_ids: [B, P + T] (int64);
    response_ids: [B, T] int64 (pad where absent); response_mask: [B, T] float32."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_len: int

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B, L] int64 positions counting real tokens from 0 (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to their max length: ([B, P] ids, [B, P] int64 mask)."""
    P = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise DataError(f"prompt {i} is empty: every sample needs at least one prompt token")
        ids[i, P - len(r) :] = torch.as_tensor(r, dtype=torch.long)
        mask[i, P - len(r) :] = 1
    return ids, mask


def pack(prompts: list[list[int]], responses: list[list[int]], *, response_len: int, pad_id: int) -> PackedBatch:
    """Concatenate left-padded prompts [B, P] and right-padded responses [B, response_len].

    `response_len` is the global T (a micro-batch keeps the global batch's T so per-token
    tensors of the loss line up)."""
    if len(prompts) != len(responses):
        raise DataError(f"{len(prompts)} prompts but {len(responses)} responses")
    p_ids, p_mask = left_pad(prompts, pad_id)
    B, T = len(prompts), response_len
    r_ids = torch.full((B, T), pad_id, dtype=torch.long)
    r_mask = torch.zeros((B, T), dtype=torch.long)
    for i, r in enumerate(responses):
        if len(r) > T:
            raise DataError(f"response {i} has {len(r)} tokens, more than the batch's T={T}")
        if r:
            r_ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            r_mask[i, : len(r)] = 1
    input_ids = torch.cat([p_ids, r_ids], dim=1)
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_ids=r_ids,
        response_mask=r_mask.float(),
        prompt_len=p_ids.shape[1],
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits (any dtype), [B, T] targets -> [B, T] fp32 log-softmax at the targets."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits -> [B, T] fp32 entropy of softmax(logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
