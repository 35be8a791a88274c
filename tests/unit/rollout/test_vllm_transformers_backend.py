"""An in-process vLLM engine on Olmo-3 (served by vLLM's Transformers backend, which decorates
the transformers decoder class for the whole process) leaves the trainer's HF models working:
one loaded before the engine gives the same log-probs after it, and loading one after it is a
one-line error naming the order (models/hf_model.py). In a child process: the decoration would
outlive the test in this one."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

SCRIPT = textwrap.dedent("""
    import sys, torch
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.interfaces.backend import SequenceBatch
    from megatron_sdpo.models.hf_model import load_causal_lm
    from megatron_sdpo.models.random_olmo3 import save_tiny_olmo3
    from megatron_sdpo.rollout import make_engine

    d = save_tiny_olmo3(sys.argv[1])
    be = HFBackend(d, lr=1e-3, micro_batch_size=4, with_teacher=False)
    batch = SequenceBatch([list(range(3, 43)), [7, 8, 9]], [[50, 51, 52, 53], [60, 61]])
    before = be.logprobs(batch)
    engine = make_engine("vllm", model_path=d, max_model_len=128)
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    assert TorchCompileWithNoGuardsWrapper in type(be.policy.model).__mro__, "vLLM no longer decorates the class"
    after = be.logprobs(batch)
    assert torch.equal(before, after), (before, after)
    try:
        load_causal_lm(d, torch.float32)
    except RuntimeError as exc:
        print("LOAD-AFTER:", exc)
    print("OK")
""")


@pytest.mark.vllm
def test_hf_models_survive_the_transformers_backend(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "olmo3")], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOAD-AFTER:"))
    assert "load HF models before building the engine" in line and "\n" not in line
