"""Chunked torch engine vs the reference (algorithms/divergence.py, the specification, applied to
materialized logits): forward and backward with grad_output != 1, odd shapes, fp32 and bf16."""

import pytest
import torch

from megatron_sdpo_kernels import ChunkSizes, fused_linear_kl, fused_linear_logprobs, resolve_impl

from kl_cases import grads_of, make_inputs, one_thread, oracle_kl  # noqa: F401

# Loss tolerance is absolute+relative on values of O(0.1..10); gradients of bf16 inputs come back in
# bf16 (8 bits of mantissa), hence the looser tolerance there.
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}
CHUNKS = [ChunkSizes(16, 100), ChunkSizes(7, 1031), ChunkSizes(1024, 8192)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(impl, x, alpha, t, chunks=None):
    fn = lambda hs, ws: fused_linear_kl(
        hs, x["ht"], ws, x["wt"], alpha=alpha, temperature=t, mask=x["mask"], impl=impl, chunk_sizes=chunks
    )
    return grads_of(fn, x["hs"], x["ws"], x["go"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunks", CHUNKS, ids=["16x100", "7x1031", "default"])
def test_chunked_kl_matches_reference(dtype, alpha, chunks):
    x = make_inputs(dtype=dtype)
    (l_ref,), dh_ref, dw_ref = _run("reference", x, alpha, 0.7)
    (loss,), dh, dw = _run("chunked", x, alpha, 0.7, chunks)
    tol = TOL[dtype]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, l_ref, **TOL[torch.float32])
    torch.testing.assert_close(dh, dh_ref, **tol)
    torch.testing.assert_close(dw, dw_ref, **tol)
    assert (dh[~x["mask"]] == 0).all()
    # Against the float64 oracle too, so that a shared mistake in both paths cannot pass.
    l_orc = oracle_kl(x["hs"], x["ht"], x["ws"], x["wt"], alpha, 0.7, x["mask"])
    torch.testing.assert_close(loss.double(), l_orc, rtol=1e-4, atol=1e-4)


def test_gradient_dtype_follows_inputs_and_no_mask_path():
    x = make_inputs(dtype=torch.bfloat16, masked=False)
    (loss,), dh, dw = grads_of(
        lambda hs, ws: fused_linear_kl(hs, x["ht"], ws, x["wt"], alpha=0.5, impl="chunked"), x["hs"], x["ws"], x["go"]
    )
    assert torch.isfinite(loss).all() and (loss > 0).all()
    hs = x["hs"].clone().requires_grad_(True)
    fused_linear_kl(hs, x["ht"], x["ws"], x["wt"], alpha=0.5).sum().backward()
    assert hs.grad.dtype == torch.bfloat16


def test_large_logits_stay_finite():
    # Logits of several hundred: a 0 running-max identity or a missing max shift would overflow.
    x = make_inputs(masked=False)
    x["hs"] = x["hs"] * 60
    x["ht"] = x["ht"] * 60
    (l_ref,), dh_ref, _ = _run("reference", x, 0.5, 1.0)
    (loss,), dh, _ = _run("chunked", x, 0.5, 1.0, ChunkSizes(16, 100))
    assert torch.isfinite(loss).all() and torch.isfinite(dh).all()
    torch.testing.assert_close(loss, l_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
def test_chunked_logprobs_match_reference(dtype, masked):
    x = make_inputs(dtype=dtype, masked=masked)
    g2 = torch.linspace(-1.0, 2.0, 37)
    res = {}
    for impl in ("reference", "chunked"):
        fn = lambda h, w, impl=impl: fused_linear_logprobs(
            h, w, x["labels"], temperature=1.3, mask=x["mask"], impl=impl, chunk_sizes=ChunkSizes(16, 100)
        )
        res[impl] = grads_of(fn, x["hs"], x["ws"], x["go"], g2)
    (lp_r, ent_r), dh_r, dw_r = res["reference"]
    (lp, ent), dh, dw = res["chunked"]
    torch.testing.assert_close(lp, lp_r, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent, ent_r, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(dh, dh_r, **TOL[dtype])
    torch.testing.assert_close(dw, dw_r, **TOL[dtype])
    assert (lp <= 0).all()


def test_auto_dispatch_picks_chunked_on_cpu():
    assert resolve_impl("auto", torch.device("cpu")) == "chunked"
    assert resolve_impl("auto", torch.device("cuda")) == "triton"
    assert resolve_impl("reference", torch.device("cuda")) == "reference"


def test_empty_batch_keeps_the_graph():
    x = make_inputs(masked=False)
    hs = x["hs"][:0].clone().requires_grad_(True)
    loss = fused_linear_kl(hs, x["ht"][:0], x["ws"], x["wt"], alpha=0.5)
    assert loss.shape == (0,)
    loss.sum().backward()
    assert hs.grad.shape == (0, 96)
    lp, ent = fused_linear_logprobs(hs, x["ws"], x["labels"][:0])
    assert lp.shape == ent.shape == (0,)
