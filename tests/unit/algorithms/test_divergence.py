"""The generalized-JSD specification (algorithms/divergence.py) against a textbook float64 oracle,
and its pieces (tile sums, analytic logit gradient) against the whole and against autograd."""

import pytest
import torch

from megatron_sdpo.algorithms.divergence import (
    combine_jsd_parts,
    generalized_jsd,
    jsd_grad_scale,
    jsd_logit_grad,
    jsd_part_sums,
    mixture_log,
)

ALPHAS = [0.0, 0.3, 0.5, 1.0]
SHAPE = (3, 7, 211)  # odd everywhere: no tile or vector width divides V


def _logits(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    zs = 3.0 * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    zt = zs + 1.5 * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    return zs.to(dtype), zt.to(dtype)


def _oracle(zs, zt, alpha):
    """Deliberately in probability space (softmax, explicit mixture, log of probabilities), float64."""
    p_s, p_t = torch.softmax(zs.double(), -1), torch.softmax(zt.double(), -1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)
    if alpha == 0.0:
        return kl(p_t, p_s)
    if alpha == 1.0:
        return kl(p_s, p_t)
    m = (1.0 - alpha) * p_s + alpha * p_t
    return (1.0 - alpha) * kl(p_s, m) + alpha * kl(p_t, m)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_spec_matches_the_oracle_in_value_and_gradient(alpha):
    zs, zt = _logits()
    go = torch.linspace(-1.0, 2.5, SHAPE[0] * SHAPE[1]).view(SHAPE[:2])  # grad_output != 1, mixed sign
    zs_spec = zs.clone().requires_grad_(True)
    d = generalized_jsd(torch.log_softmax(zs_spec, -1), torch.log_softmax(zt, -1), alpha)
    (d * go).sum().backward()
    zs_orc = zs.double().requires_grad_(True)
    d_orc = _oracle(zs_orc, zt, alpha)
    (d_orc * go.double()).sum().backward()
    assert d.dtype == torch.float32 and d.shape == SHAPE[:2] and (d > 0).all()
    # fp32 log-probabilities carry ~1e-7 relative error per term; sums of V = 211 terms of O(1).
    torch.testing.assert_close(d.double(), d_orc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(zs_spec.grad.double(), zs_orc.grad, rtol=1e-5, atol=1e-6)


def test_endpoints_are_the_two_kls_not_limits():
    zs, zt = _logits()
    a, b = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    fwd, rev = generalized_jsd(a, b, 0.0), generalized_jsd(a, b, 1.0)
    assert not torch.allclose(fwd, rev, rtol=1e-2)
    # The interior expression vanishes like alpha as alpha -> 0; the endpoint is the whole KL.
    assert generalized_jsd(a, b, 1e-6).abs().max() < 1e-3 * fwd.abs().max()
    assert torch.equal(mixture_log(a, b, 0.0), a) and torch.equal(mixture_log(a, b, 1.0), b)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_part_sums_over_vocabulary_tiles_add_up_to_the_whole(alpha):
    zs, zt = _logits(torch.float64)
    a, b = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    whole = jsd_part_sums(a, b, alpha)
    tiles = [jsd_part_sums(a[..., j : j + 50], b[..., j : j + 50], alpha) for j in range(0, SHAPE[-1], 50)]
    for k in range(2):
        torch.testing.assert_close(sum(t[k] for t in tiles), whole[k], rtol=1e-12, atol=1e-12)
    assert torch.equal(combine_jsd_parts(*whole, alpha), generalized_jsd(a, b, alpha))
    # The part that vanishes at an endpoint is exactly zero (not evaluated).
    if alpha in (0.0, 1.0):
        assert (whole[0 if alpha == 0.0 else 1] == 0).all()


@pytest.mark.parametrize("alpha", ALPHAS)
def test_analytic_logit_gradient_equals_autograd(alpha):
    # float64 so that the comparison tests the formula, not fp32 rounding.
    zs, zt = _logits(torch.float64, seed=1)
    go = torch.linspace(-1.0, 2.5, SHAPE[0] * SHAPE[1], dtype=torch.float64).view(SHAPE[:2])
    z = zs.clone().requires_grad_(True)
    a, b = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    (generalized_jsd(a, b, alpha) * go).sum().backward()
    a, b = a.detach(), b.detach()
    resid = jsd_part_sums(a, b, alpha)[0].unsqueeze(-1)
    analytic = jsd_logit_grad(a, b, alpha, resid) * (jsd_grad_scale(alpha) * go.unsqueeze(-1))
    torch.testing.assert_close(analytic, z.grad, rtol=1e-10, atol=1e-12)


def test_alpha_outside_the_unit_interval_is_rejected():
    zs, zt = _logits()
    with pytest.raises(ValueError, match="alpha"):
        generalized_jsd(torch.log_softmax(zs, -1), torch.log_softmax(zt, -1), 1.5)
