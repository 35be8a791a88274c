"""Batches and losses for the zero-signal skipping tests (algorithms/signal_rows.py), shared by the
HF and megatron backends' tests. Importable from every test folder (pytest puts tests/ on
sys.path)."""

import torch

GROUP = 4
# Rewards per prompt group: mixed groups have signal; all-0 / all-1 groups have advantage 0 and
# (all-0: no successful sibling; all-1: nobody to teach) no distillation target either. In
# batch 1 the first mini-batch (groups 0-1) has every row skipped.
REWARDS = {
    0: [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]],
    1: [[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]],
}


def skip_batch(which: int, vocab: int = 131):
    """Rollout batch `which` (0 or 1): 4 prompt groups of 4 samples, ragged prompts and
    responses, teacher prompts (a sibling's answer appended) on the failed samples of groups
    with a success, as SDPO builds them; advantages reward - group mean."""
    from megatron_sdpo.algorithms.grpo import group_advantages
    from megatron_sdpo.interfaces.backend import SequenceBatch
    from megatron_sdpo.rollout.guard import attach_guard_tensors

    g = torch.Generator().manual_seed(100 + which)
    ids = lambda n: [int(x) for x in torch.randint(3, vocab, (n,), generator=g)]
    rewards = torch.tensor(REWARDS[which], dtype=torch.float32)
    prompts, responses, teacher = [], [], []
    for grp in range(rewards.shape[0]):
        p = ids(3 + 2 * grp)
        rs = [ids(int(n)) for n in torch.randint(1, 7, (GROUP,), generator=g)]
        win = next((r for r, x in zip(rs, rewards[grp], strict=True) if x >= 1), None)
        for r, x in zip(rs, rewards[grp], strict=True):
            prompts.append(p)
            responses.append(r)
            teacher.append(p + ids(2) + win if win is not None and x < 1 else None)
    b = SequenceBatch(prompts, responses, teacher, {})
    mask = b.response_mask()
    has = torch.tensor([t is not None for t in teacher], dtype=torch.float32)
    b.tensors.update(
        loss_mask=mask,
        distill_mask=mask * has[:, None],
        advantages=group_advantages(rewards.reshape(-1), group_size=GROUP, norm_by_std=False),
        # Near the tiny models' uniform log(1/131): TIS weights around 1, some capped.
        rollout_logprobs=(-4.9 + 0.5 * torch.randn(mask.shape, generator=g)) * mask,
    )
    attach_guard_tensors(b.tensors, mask)
    return b


def skip_loss(kind: str):
    """GRPO (clip-higher, dual clip, TIS), SDPO (full-vocabulary JSD with IS weights) or the
    hybrid of both, each reading old log-probabilities (mini-batches)."""
    from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss

    grpo = GRPOLoss(clip_low=0.2, clip_high=0.28, tis_cap=2.0, dual_clip=3.0, on_policy=False)
    sdpo = SDPOLoss(variant="logits", alpha=0.5, topk=None, is_clip=2.0, mask_key="distill_mask")
    return {"grpo": grpo, "sdpo": sdpo, "hybrid": HybridLoss(sdpo=sdpo, grpo=grpo, lam=0.5)}[kind]
