"""SDPO distillation losses against float64 probability-space references written here."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sdpo.algorithms.sdpo import (
    distill_mask,
    importance_weights,
    sampled_token_loss,
    token_distillation_loss,
)
from megatron_sdpo.errors import ConfigError

B, T, V = 3, 7, 37


def _ref_dists(s_logits, t_logits, topk, tail):
    p = torch.softmax(s_logits.double(), -1)
    q = torch.softmax(t_logits.double(), -1)
    if topk is None:
        return p, q
    idx = torch.argsort(p.detach(), dim=-1, descending=True)[..., :topk]
    ps, qs = p.gather(-1, idx), q.gather(-1, idx)
    if tail:
        return (torch.cat([ps, 1 - ps.sum(-1, keepdim=True)], -1), torch.cat([qs, 1 - qs.sum(-1, keepdim=True)], -1))
    return ps / ps.sum(-1, keepdim=True), qs / qs.sum(-1, keepdim=True)


def _ref_gjsd(p, q, a):
    if a == 0:
        return (q * (q / p).log()).sum(-1)
    if a == 1:
        return (p * (p / q).log()).sum(-1)
    m = (1 - a) * p + a * q
    return (1 - a) * (p * (p / m).log()).sum(-1) + a * (q * (q / m).log()).sum(-1)


def _ref_loss(s_logits, t_logits, mask, a, topk=None, tail=True, w=None, norm=None, temp=1.0):
    p, q = _ref_dists(s_logits / temp, t_logits.detach() / temp, topk, tail)
    per = _ref_gjsd(p, q, a)
    w = torch.ones_like(per) if w is None else w.double()
    norm = mask.double().sum() if norm is None else norm
    return (per * w * mask.double()).sum() / norm


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = (2 * torch.randn(B, T, V, generator=g)).to(dtype)
    # the teacher is a perturbed student, as a re-prompted copy of the same model would be
    t = (s.float() + torch.randn(B, T, V, generator=g)).to(dtype)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    w = torch.rand(B, T, generator=g) * 2
    return s, t, mask, w


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 0.3])
@pytest.mark.parametrize("topk,tail", [(None, True), (5, True), (5, False)])
def test_loss_and_grad_match_reference_fp32(alpha, topk, tail):
    s, t, mask, w = _inputs()
    a = s.clone().requires_grad_(True)
    tt = t.clone().requires_grad_(True)
    loss, metrics = token_distillation_loss(a, tt, mask, alpha=alpha, topk=topk, add_tail=tail, is_weights=w)
    (loss * 1.7).backward()
    b = s.double().clone().requires_grad_(True)
    ref = _ref_loss(b, t.double(), mask, alpha, topk, tail, w)
    (ref * 1.7).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-6, rtol=1e-4)
    assert tt.grad is None  # the teacher is a target, never trained through this loss
    assert torch.all(a.grad[mask == 0] == 0)
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_bf16_inputs_use_fp32_maths(alpha):
    _, _, mask, w = _inputs(seed=1)
    g = torch.Generator().manual_seed(11)
    # distinct multiples of 1/8 are exact in bf16: no ties, so top-k ids are unambiguous
    s = torch.stack([torch.randperm(V, generator=g) for _ in range(B * T)]).view(B, T, V).float() / 8 - 2
    t = (s + torch.randn(B, T, V, generator=g)).to(torch.bfloat16)
    s = s.to(torch.bfloat16)
    a = s.clone().requires_grad_(True)
    loss, _ = token_distillation_loss(a, t, mask, alpha=alpha, topk=7, is_weights=w)
    (loss * 0.4).backward()
    b = s.double().clone().requires_grad_(True)
    ref = _ref_loss(b, t.double(), mask, alpha, 7, True, w)
    (ref * 0.4).backward()
    assert loss.dtype == torch.float32 and a.grad.dtype == torch.bfloat16
    # maths is fp32 on the same bf16 values: only the returned gradient is rounded to bf16
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-2)


def test_endpoints_are_the_exact_kls_and_the_limits_of_the_interior():
    s, t, mask, _ = _inputs(seed=2)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    forward = F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1)  # KL(q || s)
    reverse = F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)  # KL(s || q)
    n = mask.sum()
    l0, _ = token_distillation_loss(s, t, mask, alpha=0.0)
    l1, _ = token_distillation_loss(s, t, mask, alpha=1.0)
    torch.testing.assert_close(l0, (forward * mask).sum() / n)
    torch.testing.assert_close(l1, (reverse * mask).sum() / n)
    assert not torch.allclose(l0, l1, rtol=1e-2)
    # the interior expression behaves like a * KL(q||s) near 0 and (1 - a) * KL(s||q) near 1
    eps = 1e-3
    near0, _ = token_distillation_loss(s, t, mask, alpha=eps)
    near1, _ = token_distillation_loss(s, t, mask, alpha=1 - eps)
    assert near0.item() / eps == pytest.approx(l0.item(), rel=2e-2)
    assert near1.item() / eps == pytest.approx(l1.item(), rel=2e-2)


def test_jsd_is_symmetric_at_half_and_zero_for_equal_distributions():
    s, t, mask, _ = _inputs(seed=3)
    ab, _ = token_distillation_loss(s, t, mask, alpha=0.5)
    ba, _ = token_distillation_loss(t, s, mask, alpha=0.5)
    torch.testing.assert_close(ab, ba)
    assert 0 < ab.item() < math.log(2)
    same = s.clone().requires_grad_(True)
    for alpha in (0.0, 0.5, 1.0):
        loss, _ = token_distillation_loss(same, s, mask, alpha=alpha)
        loss.backward()
        assert abs(loss.item()) < 1e-6
        assert same.grad.abs().max().item() < 1e-6
        same.grad = None


def test_topk_equal_to_vocab_matches_full_vocabulary():
    s, t, mask, _ = _inputs(seed=4)
    full, _ = token_distillation_loss(s, t, mask, alpha=0.5)
    with_tail, m = token_distillation_loss(s, t, mask, alpha=0.5, topk=V, add_tail=True)
    no_tail, _ = token_distillation_loss(s, t, mask, alpha=0.5, topk=V, add_tail=False)
    torch.testing.assert_close(no_tail, full)
    torch.testing.assert_close(with_tail, full, atol=1e-5, rtol=1e-4)
    assert m["sdpo/topk_mass_student"].item() == pytest.approx(1.0, abs=1e-5)


def test_peaked_distribution_tail_stays_finite():
    s = torch.zeros(1, 2, V)
    s[..., 3] = 40.0  # top-1 holds all but ~1e-16 of the mass: fp32 rounds the tail to 0
    s.requires_grad_(True)
    t = torch.randn(1, 2, V)
    loss, _ = token_distillation_loss(s, t, torch.ones(1, 2), alpha=0.5, topk=1, add_tail=True)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all()


def test_masked_vocabulary_entries_do_not_produce_nan():
    s, t, mask, _ = _inputs(seed=5)
    t = t.clone()
    t[..., -4:] = float("-inf")  # padded vocabulary rows of a sharded/padded LM head
    a = s.clone().requires_grad_(True)
    loss, _ = token_distillation_loss(a, t, mask, alpha=0.0, topk=None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()
    # kl_div treats 0 * log 0 as 0 where the teacher has no mass
    per = F.kl_div(torch.log_softmax(s.double(), -1), torch.softmax(t.double(), -1), reduction="none").sum(-1)
    torch.testing.assert_close(loss.double(), (per * mask).sum() / mask.sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_closed_form_gradient_equals_autograd_with_padded_vocabulary_on_both_sides(alpha):
    """The full-vocabulary loss's backward (closed form) against autograd through
    generalized_jsd of the same floored log-probabilities, with -inf logits (padded vocabulary)
    in the student and the teacher, a temperature and grad_output != 1."""
    from megatron_sdpo.algorithms.divergence import generalized_jsd

    s, t, mask, w = _inputs(seed=8)
    s, t = s.clone(), t.clone()
    s[..., -3:] = float("-inf")
    t[..., -4:] = float("-inf")
    a = s.clone().requires_grad_(True)
    loss, metrics = token_distillation_loss(a, t, mask, alpha=alpha, is_weights=w, normalizer=7.0, temperature=1.3)
    (loss * -2.1).backward()
    b = s.clone().requires_grad_(True)
    la = torch.log_softmax(b / 1.3, -1).clamp_min(-1.0e4)
    lb = torch.log_softmax(t / 1.3, -1).clamp_min(-1.0e4)
    ref = (generalized_jsd(la, lb, alpha) * w * mask).sum() / 7.0
    (ref * -2.1).backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    # Both are fp32 sums over the 37 ids of terms of size ~|s|: a few ulps of the largest entry.
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    assert torch.all(a.grad[..., -3:] == 0) and torch.isfinite(a.grad).all()
    entropy = -(la.exp() * la).sum(-1)
    torch.testing.assert_close(metrics["sdpo/student_entropy"], (entropy * mask).sum() / 7.0)


def test_temperature_scales_both_logit_sets():
    s, t, mask, _ = _inputs(seed=6)
    got, _ = token_distillation_loss(s, t, mask, alpha=0.5, topk=9, temperature=2.0)
    ref = _ref_loss(s.double(), t.double(), mask, 0.5, 9, True, temp=2.0)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("topk", [None, 6])
def test_micro_batches_sum_to_the_global_loss_and_gradient(topk):
    s, t, mask, w = _inputs(seed=7)
    n = mask.sum()
    full = s.clone().requires_grad_(True)
    loss, _ = token_distillation_loss(full, t, mask, alpha=0.5, topk=topk, is_weights=w, normalizer=n)
    (loss * 2.3).backward()
    parts = s.clone().requires_grad_(True)
    total = 0
    for idx in ([0], [1, 2]):
        part, _ = token_distillation_loss(
            parts[idx], t[idx], mask[idx], alpha=0.5, topk=topk, is_weights=w[idx], normalizer=n
        )
        total = total + part
    (total * 2.3).backward()
    torch.testing.assert_close(total, loss)
    torch.testing.assert_close(parts.grad, full.grad)
    # the default normalizer is the local token count, so halves alone are *means* of their own
    local, _ = token_distillation_loss(s[[0]], t[[0]], mask[[0]], alpha=0.5, topk=topk, is_weights=w[[0]])
    torch.testing.assert_close(
        local * mask[[0]].sum() / n,
        token_distillation_loss(s[[0]], t[[0]], mask[[0]], alpha=0.5, topk=topk, is_weights=w[[0]], normalizer=n)[0],
    )


def test_metrics_entropies_and_empty_mask():
    s, t, mask, _ = _inputs(seed=8)
    _, m = token_distillation_loss(s, t, mask, alpha=0.5, topk=4)
    p = torch.softmax(s.double(), -1)
    ent = -(p * p.log()).sum(-1)
    assert m["sdpo/student_entropy"].item() == pytest.approx(((ent * mask).sum() / mask.sum()).item(), rel=1e-5)
    top = torch.sort(p, -1, descending=True).values[..., :4].sum(-1)
    assert m["sdpo/topk_mass_student"].item() == pytest.approx(((top * mask).sum() / mask.sum()).item(), rel=1e-5)
    a = s.clone().requires_grad_(True)
    loss, _ = token_distillation_loss(a, t, torch.zeros(B, T), alpha=0.5)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(a.grad, torch.zeros_like(a))


def test_argument_errors():
    s, t, mask, _ = _inputs()
    with pytest.raises(ValueError, match="alpha"):  # the divergence's guard (the config names the key)
        token_distillation_loss(s, t, mask, alpha=1.5)
    with pytest.raises(ConfigError, match="topk"):
        token_distillation_loss(s, t, mask, alpha=0.5, topk=V + 1)
    with pytest.raises(ValueError, match="shape"):
        token_distillation_loss(s, t[:, :-1], mask, alpha=0.5)


def test_importance_weights_are_clipped_and_detached():
    now = torch.tensor([[0.0, 0.0, -1.0, 50.0]], requires_grad=True)
    roll = torch.tensor([[0.0, -0.5, 0.0, 0.0]])
    w = importance_weights(now, roll, clip=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5), math.exp(-1.0), 2.0]]))
    assert not w.requires_grad and w.dtype == torch.float32
    with pytest.raises(ConfigError):
        importance_weights(now, roll, clip=0.0)


def test_sampled_token_loss_value_and_gradient():
    g = torch.Generator().manual_seed(9)
    s = -torch.rand(B, T, generator=g) * 4
    q = -torch.rand(B, T, generator=g) * 4
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    w = torch.rand(B, T, generator=g) + 0.5
    a = s.clone().requires_grad_(True)
    qq = q.clone().requires_grad_(True)
    loss, m = sampled_token_loss(a, qq, mask, normalizer=mask.sum(), is_weights=w)
    (loss * 1.7).backward()
    # value: sum w (s - q) s / N ; gradient: w (s - q) / N (the gap is a constant)
    torch.testing.assert_close(loss, (w * (s - q) * s * mask).sum() / mask.sum())
    torch.testing.assert_close(a.grad, 1.7 * w * (s - q) * mask / mask.sum())
    assert qq.grad is None
    assert m["sdpo/sampled_kl"].item() == pytest.approx(((s - q) * mask).sum().item() / mask.sum().item(), rel=1e-5)


END = [7, 8]  # ids of a two-token reasoning-end marker


def _bits(*rows: str):
    """A float 0/1 mask written a row a string, a character a token."""
    return torch.tensor([[float(c) for c in row] for row in rows])


def test_distill_mask_keeps_tokens_after_the_last_marker():
    ids = torch.tensor(
        [
            [1, 7, 8, 2, 3, 0, 0],  # marker at 1-2 -> keep 3, 4
            [7, 8, 4, 7, 8, 5, 6],  # two markers: the last one counts -> keep 5, 6
            [1, 2, 3, 4, 0, 0, 0],  # no marker: keep all real tokens
            [1, 2, 3, 7, 0, 0, 0],  # marker cut by padding; padded 8 below must not count
        ]
    )
    ids[3, 4] = 8
    mask = _bits("1111100", "1111111", "1111000", "1111000")
    got = distill_mask(ids, mask, reasoning_end_ids=END, distill_cot=False)
    want = _bits("0001100", "0000011", "1111000", "1111000")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(distill_mask(ids, mask, reasoning_end_ids=END, distill_cot=True), mask)
    single = distill_mask(ids, mask, reasoning_end_ids=[2], distill_cot=False)
    torch.testing.assert_close(single[0], torch.tensor([0, 0, 0, 0, 1, 0, 0.0]))
    with pytest.raises(ConfigError, match="reasoning_end_ids"):
        distill_mask(ids, mask, reasoning_end_ids=None, distill_cot=False)
