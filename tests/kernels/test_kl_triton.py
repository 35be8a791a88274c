"""Triton engine under TRITON_INTERPRET=1 on CPU at small odd shapes, against the reference (the
specification of algorithms/divergence.py on materialized logits), grad_output != 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONFAULTHANDLER="1")
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    proc = subprocess.run(
        [sys.executable, str(HERE / "kl_triton_cases.py")], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


# Relative max errors (max |diff| / max |ref|). bf16 gradients are returned in bf16.
TOL = {"torch.float32": (1e-5, 1e-5), "torch.bfloat16": (1e-5, 4e-3)}


@pytest.mark.triton
def test_triton_kl_and_logprobs_match_reference(interpreter_results):
    assert len(interpreter_results) == 7
    for case in interpreter_results:
        loss_tol, grad_tol = TOL[case["dtype"]]
        assert case["finite"] and case["masked_zero"], case
        assert case["loss"] < loss_tol, case
        assert case["dh"] < grad_tol, case
        assert case["dw"] < grad_tol, case


@pytest.mark.triton
def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    from megatron_sdpo.errors import UserError
    from megatron_sdpo_kernels import fused_linear_kl

    x = torch.randn(4, 16)
    w = torch.randn(32, 16)
    with pytest.raises(UserError, match="TRITON_INTERPRET"):
        fused_linear_kl(x, x, w, w, alpha=0.5, impl="triton")
