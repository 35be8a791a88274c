"""CUDA checks of the Triton engine (skipped without a GPU): real tensor cores, bf16 and TP-free."""

import pytest
import torch

from megatron_sdpo_kernels import fused_linear_kl, fused_linear_logprobs

from kl_cases import grads_of, make_inputs


def _to_cuda(x):
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_triton_cuda_matches_reference(dtype, alpha):
    x = _to_cuda(make_inputs(n=301, h=256, v=5003, dtype=dtype))
    res = {}
    for impl in ("reference", "triton"):
        fn = lambda hs, ws, impl=impl: fused_linear_kl(
            hs, x["ht"], ws, x["wt"], alpha=alpha, temperature=0.7, mask=x["mask"], impl=impl
        )
        res[impl] = grads_of(fn, x["hs"], x["ws"], x["go"])
    (l_r,), dh_r, dw_r = res["reference"]
    (l_t,), dh_t, dw_t = res["triton"]
    # bf16 tensor-core products accumulate in fp32 but are not bit-equal to the upcast reference.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(l_t, l_r, **tol)
    torch.testing.assert_close(dh_t, dh_r, **tol)
    torch.testing.assert_close(dw_t, dw_r, **tol)


@pytest.mark.gpu
@pytest.mark.triton
def test_triton_cuda_logprobs_and_auto_dispatch():
    x = _to_cuda(make_inputs(n=129, h=128, v=3001, dtype=torch.bfloat16))
    out = {}
    for impl in ("reference", "auto"):
        fn = lambda h, w, impl=impl: fused_linear_logprobs(h, w, x["labels"], mask=x["mask"], impl=impl)
        out[impl] = grads_of(fn, x["hs"], x["ws"], x["go"], x["go"].flip(0))
    for a, b in zip(out["auto"][0], out["reference"][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out["auto"][1], out["reference"][1], rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
def test_liger_fused_linear_jsd_agrees_on_the_mean():
    liger = pytest.importorskip("liger_kernel.transformers")
    x = _to_cuda(make_inputs(n=256, h=128, v=4096, masked=False))
    ours = fused_linear_kl(x["hs"], x["ht"], x["ws"], x["wt"], alpha=0.5, impl="triton").mean()
    theirs = liger.LigerFusedLinearJSD(jsd_beta=0.5)(x["hs"], x["ws"], x["ht"], x["wt"], None)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-3, atol=1e-4)
