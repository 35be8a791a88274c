"""GRPO advantages and clipped loss against plain references written here."""

import statistics

import pytest
import torch

from megatron_sdpo.algorithms.grpo import group_advantages, policy_loss
from megatron_sdpo.errors import ConfigError


def _ref_advantages(rewards, group_size, norm_by_std, eps):
    out = []
    for g in range(0, len(rewards), group_size):
        grp = rewards[g : g + group_size]
        mu = sum(grp) / len(grp)
        sd = statistics.stdev(grp) if len(grp) > 1 else 0.0
        for r in grp:
            if max(grp) == min(grp):
                out.append(0.0)
            elif norm_by_std:
                out.append((r - mu) / (sd + eps))
            else:
                out.append(r - mu)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_match_reference(norm_by_std):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5 * 3, generator=g)
    rewards[3:6] = 0.7  # a constant group
    got = group_advantages(rewards, group_size=3, norm_by_std=norm_by_std)
    ref = _ref_advantages(rewards.double().tolist(), 3, norm_by_std, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3:6], torch.zeros(3))


def test_group_advantages_constant_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive mean leaves a residue that /eps would blow up.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, group_size=3, norm_by_std=True)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3] > 0 and adv[4] < 0


def test_group_advantages_group_of_one_and_errors():
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0]), group_size=1, norm_by_std=True), torch.zeros(2))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.ones(6), group_size=4, norm_by_std=True)
    with pytest.raises(ConfigError):
        group_advantages(torch.ones(6), group_size=0, norm_by_std=True)


def _ref_policy_loss(lp, old, adv, mask, norm, cl, ch, ref=None, kl_coef=0.0, rollout=None, cap=None):
    """Case-by-case PPO objective in float64 (the max(-A r, -A clip r) form rewritten by sign of A)."""
    lp, old, mask = lp.double(), old.double(), mask.double()
    adv = adv.double()
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(lp)
    r = torch.exp(lp - old)
    pos = -adv * torch.minimum(r, torch.full_like(r, 1 + ch))
    neg = -adv * torch.maximum(r, torch.full_like(r, 1 - cl))
    pg = torch.where(adv >= 0, pos, neg)
    if cap is not None:
        w = torch.exp(old - rollout.double())
        w = torch.where(w > cap, torch.full_like(w, cap), w)
        pg = pg * w
    if kl_coef:
        x = ref.double() - lp
        pg = pg + kl_coef * (torch.exp(x) - x - 1)
    return (pg * mask).sum() / norm


def _inputs(dtype=torch.float32, per_token_adv=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 7
    old = -torch.rand(B, T, generator=g) * 3
    # ratios spread over [0.5, 1.6] so every clip branch occurs
    lp = (old + torch.empty(B, T).uniform_(-0.7, 0.45, generator=g)).to(dtype)
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.tensor([1.3, -0.8, 0.5])
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[:, 0] = 1
    return lp, old, adv, mask


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_policy_loss_and_grad_match_reference(dtype, tol, per_token_adv):
    lp, old, adv, mask = _inputs(dtype, per_token_adv)
    g = torch.Generator().manual_seed(1)
    ref_lp = old + 0.1 * torch.randn(3, 7, generator=g)
    rollout = old + 0.2 * torch.randn(3, 7, generator=g)
    norm = mask.sum()
    kw = dict(clip_low=0.2, clip_high=0.28)
    a = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        a,
        old,
        adv,
        mask,
        normalizer=norm,
        ref_logprobs=ref_lp,
        kl_coef=0.3,
        rollout_logprobs=rollout,
        tis_cap=1.5,
        **kw,
    )
    (loss * 1.7).backward()
    b = lp.double().clone().requires_grad_(True)
    ref = _ref_policy_loss(b, old, adv, mask, norm.double(), 0.2, 0.28, ref_lp, 0.3, rollout, 1.5)
    (ref * 1.7).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(a.grad.double(), b.grad, atol=tol, rtol=tol)
    assert a.grad.dtype == dtype
    assert torch.all(a.grad[mask == 0] == 0)
    for v in metrics.values():
        assert not v.requires_grad and torch.isfinite(v)


def test_clip_branches_gradients_and_fractions():
    # one token per case: (advantage, ratio)
    cases = [(1.0, 1.5), (1.0, 0.5), (-1.0, 0.5), (-1.0, 1.5), (1.0, 1.1), (-1.0, 0.9)]
    adv = torch.tensor([c[0] for c in cases])[:, None]
    ratio = torch.tensor([c[1] for c in cases])[:, None]
    old = torch.zeros(len(cases), 1)
    lp = torch.log(ratio).requires_grad_(True)
    mask = torch.ones(len(cases), 1)
    loss, m = policy_loss(lp, old, adv, mask, normalizer=mask.sum(), clip_low=0.2, clip_high=0.28)
    loss.backward()
    grad = lp.grad.squeeze(1)
    # A > 0, r above 1 + clip_high: clipped, no gradient; A > 0, r below: pushes r up (-A r).
    assert grad[0] == 0
    assert grad[1] == pytest.approx(-1.0 * 0.5 / 6)
    # A < 0, r below 1 - clip_low: clipped; A < 0, r above 1 + clip_high: unclipped (no upper clip).
    assert grad[2] == 0
    assert grad[3] == pytest.approx(1.0 * 1.5 / 6)
    assert grad[4] == pytest.approx(-1.1 / 6) and grad[5] == pytest.approx(0.9 / 6)
    assert m["grpo/clip_frac"].item() == pytest.approx(2 / 6)
    assert m["grpo/clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["grpo/clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["grpo/ratio_max"].item() == pytest.approx(1.5) and m["grpo/ratio_min"].item() == pytest.approx(0.5)


def test_tis_weight_is_capped_and_detached():
    lp = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[0.0, -1.0, 1.0]])  # weights exp(old - rollout) = 1, e, 1/e
    mask = torch.ones(1, 3)
    adv = torch.tensor([2.0])
    loss, m = policy_loss(lp, old, adv, mask, normalizer=3.0, rollout_logprobs=rollout, tis_cap=2.0)
    loss.backward()
    w = torch.tensor([1.0, 2.0, torch.exp(torch.tensor(-1.0)).item()])
    torch.testing.assert_close(loss, -(2.0 * w).sum() / 3)
    torch.testing.assert_close(lp.grad, (-2.0 * w / 3)[None])
    assert m["grpo/tis_weight_mean"].item() == pytest.approx(w.mean().item())


def test_k3_kl_value_gradient_and_zero_at_reference():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.5]])
    mask = torch.ones(1, 3)
    zero_adv = torch.zeros(1)
    loss, m = policy_loss(lp, lp.detach(), zero_adv, mask, normalizer=3.0, ref_logprobs=ref, kl_coef=0.5)
    loss.backward()
    d = ref - lp.detach()
    torch.testing.assert_close(loss, 0.5 * (torch.exp(d) - d - 1).sum() / 3)
    torch.testing.assert_close(lp.grad, 0.5 * (1 - torch.exp(d)) / 3)
    assert lp.grad[0, 0] == 0  # k3 is flat where lp == ref
    assert m["grpo/kl"].item() == pytest.approx(((torch.exp(d) - d - 1).sum() / 3).item())


def test_micro_batches_sum_to_the_global_loss_and_gradient():
    lp, old, adv, mask = _inputs(per_token_adv=True, seed=3)
    norm = mask.sum()
    full = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(full, old, adv, mask, normalizer=norm)
    (loss * 0.6).backward()
    parts = lp.clone().requires_grad_(True)
    total = 0
    for idx in ([0, 1], [2]):
        part, _ = policy_loss(parts[idx], old[idx], adv[idx], mask[idx], normalizer=norm)
        total = total + part
    (total * 0.6).backward()
    torch.testing.assert_close(total, loss)
    torch.testing.assert_close(parts.grad, full.grad)


def test_empty_mask_gives_zero_not_nan():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, _ = policy_loss(lp, lp.detach(), torch.ones(2), mask, normalizer=mask.sum())
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3))


def test_policy_loss_argument_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), normalizer=6, kl_coef=0.1)
    with pytest.raises(ConfigError, match="rollout_logprobs"):
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), normalizer=6, tis_cap=2.0)
    with pytest.raises(ConfigError, match="clip_low"):
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), normalizer=6, clip_low=1.5)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(lp, torch.zeros(2, 4), torch.ones(2), torch.ones(2, 3), normalizer=6)


def test_dual_clip_bounds_negative_advantages_only():
    # Ratios 0.5, 1, 5 and 10 with A = -1: the clipped surrogate max(-A r, -A clip(r)) is
    # 0.8, 1, 5, 10; dual-clip c = 3 caps the last two at 3. A = +1 is untouched.
    lp = torch.log(torch.tensor([[0.5, 1.0, 5.0, 10.0]])).requires_grad_(True)
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    neg, m = policy_loss(lp, old, torch.tensor([-1.0]), mask, normalizer=4.0, dual_clip=3.0)
    assert float(neg.detach()) == pytest.approx((0.8 + 1.0 + 3.0 + 3.0) / 4)
    assert float(m["grpo/clip_frac_dual"]) == pytest.approx(0.5)
    neg.backward()
    # The dual-clipped tokens carry no gradient; the unclipped ratio-1 token carries d(r)/d(lp) = r.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.25, 0.0, 0.0]]))
    pos, m = policy_loss(lp.detach(), old, torch.tensor([1.0]), mask, normalizer=4.0, dual_clip=3.0)
    plain, _ = policy_loss(lp.detach(), old, torch.tensor([1.0]), mask, normalizer=4.0)
    assert float(pos) == float(plain) and float(m["grpo/clip_frac_dual"]) == 0.0
    with pytest.raises(ConfigError, match="dual_clip"):
        policy_loss(lp.detach(), old, torch.tensor([1.0]), mask, normalizer=4.0, dual_clip=1.0)
