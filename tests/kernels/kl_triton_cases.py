"""Run the Triton engine under the interpreter and print its errors against the reference as JSON.

Executed in a fresh process by test_kl_triton.py: TRITON_INTERPRET must be set before triton
decorates the kernels, which a shared pytest process cannot guarantee.
"""

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_sdpo_kernels import fused_linear_kl, fused_linear_logprobs  # noqa: E402

from kl_cases import grads_of, make_inputs  # noqa: E402


def _err(a, b):
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


def main():
    torch.set_num_threads(1)
    out = []
    for dtype, alpha in [
        (torch.float32, 0.0),
        (torch.float32, 0.5),
        (torch.float32, 1.0),
        (torch.bfloat16, 0.5),
        (torch.bfloat16, 1.0),
    ]:
        x = make_inputs(dtype=dtype)
        res = {}
        for impl in ("reference", "triton"):
            fn = lambda hs, ws, x=x, alpha=alpha, impl=impl: fused_linear_kl(
                hs, x["ht"], ws, x["wt"], alpha=alpha, temperature=0.7, mask=x["mask"], impl=impl
            )
            res[impl] = grads_of(fn, x["hs"], x["ws"], x["go"])
        (l_r,), dh_r, dw_r = res["reference"]
        (l_t,), dh_t, dw_t = res["triton"]
        masked_zero = bool((l_t[~x["mask"]] == 0).all() and (dh_t[~x["mask"]] == 0).all())
        out.append(
            dict(
                kind="kl",
                dtype=str(dtype),
                alpha=alpha,
                loss=_err(l_t, l_r),
                dh=_err(dh_t, dh_r),
                dw=_err(dw_t, dw_r),
                masked_zero=masked_zero,
                finite=bool(torch.isfinite(l_t).all()),
            )
        )
    for dtype in (torch.float32, torch.bfloat16):
        x = make_inputs(dtype=dtype)
        g2 = torch.linspace(-1.0, 2.0, x["hs"].shape[0])
        res = {}
        for impl in ("reference", "triton"):
            fn = lambda h, w, x=x, impl=impl: fused_linear_logprobs(
                h, w, x["labels"], temperature=1.3, mask=x["mask"], impl=impl
            )
            res[impl] = grads_of(fn, x["hs"], x["ws"], x["go"], g2)
        (lp_r, ent_r), dh_r, dw_r = res["reference"]
        (lp_t, ent_t), dh_t, dw_t = res["triton"]
        out.append(
            dict(
                kind="logprobs",
                dtype=str(dtype),
                loss=max(_err(lp_t, lp_r), _err(ent_t, ent_r)),
                dh=_err(dh_t, dh_r),
                dw=_err(dw_t, dw_r),
                masked_zero=True,
                finite=True,
            )
        )
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
