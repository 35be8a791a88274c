"""The reference (the divergence specification, algorithms/divergence.py, on materialized logits)
against an independent float64 oracle, and input checks."""

import pytest
import torch

from megatron_sdpo.errors import ConfigError, UserError
from megatron_sdpo_kernels import fused_linear_kl, fused_linear_logprobs, reference_linear_kl, reference_linear_logprobs

from kl_cases import grads_of, make_inputs, one_thread, oracle_kl, oracle_logprobs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_reference_kl_matches_oracle_fwd_bwd(alpha):
    x = make_inputs()
    t = 0.7
    ref = lambda hs, ws: reference_linear_kl(hs, x["ht"], ws, x["wt"], alpha=alpha, temperature=t, mask=x["mask"])
    orc = lambda hs, ws: oracle_kl(hs, x["ht"], ws, x["wt"], alpha, t, x["mask"])
    (l_ref,), dh_ref, dw_ref = grads_of(ref, x["hs"], x["ws"], x["go"])
    (l_orc,), dh_orc, dw_orc = grads_of(orc, x["hs"], x["ws"], x["go"])
    assert l_ref.dtype == torch.float32 and l_ref.shape == (37,)
    assert (l_ref[~x["mask"]] == 0).all() and (dh_ref[~x["mask"]] == 0).all()
    assert (l_ref[x["mask"]] > 0).all()
    torch.testing.assert_close(l_ref.double(), l_orc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh_ref.double(), dh_orc, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw_ref.double(), dw_orc, rtol=1e-4, atol=1e-5)


def test_endpoints_are_the_two_kls_not_limits():
    x = make_inputs(masked=False)
    fwd = reference_linear_kl(x["hs"], x["ht"], x["ws"], x["wt"], alpha=0.0)
    rev = reference_linear_kl(x["hs"], x["ht"], x["ws"], x["wt"], alpha=1.0)
    tiny = reference_linear_kl(x["hs"], x["ht"], x["ws"], x["wt"], alpha=1e-6)
    assert not torch.allclose(fwd, rev, rtol=1e-2)
    # The mixture vanishes as alpha -> 0, the endpoint is the full forward KL.
    assert tiny.abs().max() < 1e-3 * fwd.abs().max()


def test_teacher_gets_no_gradient():
    x = make_inputs()
    ht = x["ht"].clone().requires_grad_(True)
    wt = x["wt"].clone().requires_grad_(True)
    hs = x["hs"].clone().requires_grad_(True)
    for impl in ("reference", "chunked"):
        fused_linear_kl(hs, ht, x["ws"], wt, alpha=0.5, impl=impl).sum().backward()
        assert ht.grad is None and wt.grad is None and hs.grad is not None


def test_reference_logprobs_match_oracle():
    x = make_inputs()
    g2 = torch.linspace(-1, 2, 37)
    ref = lambda h, w: reference_linear_logprobs(h, w, x["labels"], temperature=1.3, mask=x["mask"])
    orc = lambda h, w: oracle_logprobs(h, w, x["labels"], 1.3, x["mask"])
    (lp, ent), dh, dw = grads_of(ref, x["hs"], x["ws"], x["go"], g2)
    (lp_o, ent_o), dh_o, dw_o = grads_of(orc, x["hs"], x["ws"], x["go"], g2)
    torch.testing.assert_close(lp.double(), lp_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh.double(), dh_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw_o, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, err, text",
    [
        (dict(alpha=1.5), ConfigError, "alpha"),
        (dict(alpha=0.5, temperature=0.0), ConfigError, "temperature"),
        (dict(alpha=0.5, impl="cuda"), ConfigError, "impl"),
        (dict(alpha=0.5, mask=torch.ones(5, dtype=torch.bool)), UserError, "mask"),
        (dict(alpha=0.5, mask=torch.ones(37)), UserError, "mask"),
    ],
)
def test_bad_arguments_raise_one_line_errors(kwargs, err, text):
    x = make_inputs(masked=False)
    with pytest.raises(err, match=text):
        fused_linear_kl(x["hs"], x["ht"], x["ws"], x["wt"], **kwargs)


def test_bad_shapes_and_labels():
    x = make_inputs(masked=False)
    with pytest.raises(UserError, match="student_weight"):
        fused_linear_kl(x["hs"], x["ht"], x["ws"][:, :5], x["wt"], alpha=0.5)
    with pytest.raises(UserError, match="vocabularies differ"):
        fused_linear_kl(x["hs"], x["ht"], x["ws"], x["wt"][:-1], alpha=0.5)
    with pytest.raises(UserError, match="token ids"):
        fused_linear_logprobs(x["hs"], x["ws"], x["labels"] + 2000)
    with pytest.raises(UserError, match="2-D"):
        fused_linear_logprobs(x["hs"][0], x["ws"], x["labels"])
