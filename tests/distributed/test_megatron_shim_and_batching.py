"""The CPU shim (in a child process: it changes torch globally) and the row layout."""

import subprocess
import sys
import textwrap

import pytest
import torch

SHIM_CHECK = textwrap.dedent(
    """
    import torch
    from megatron_sdpo.backends.megatron import cpu
    assert not cpu.installed()
    cpu.install(); cpu.install()  # idempotent
    assert cpu.installed()
    x = torch.zeros(3, device="cuda")
    assert x.device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.to(torch.float64).dtype == torch.float64
    assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64
    torch.cuda.manual_seed(5); a = torch.rand(4)
    torch.cuda.manual_seed(5); b = torch.rand(4)
    assert torch.equal(a, b)
    state = torch.cuda.get_rng_state(); c = torch.rand(2); torch.cuda.set_rng_state(state)
    assert torch.equal(c, torch.rand(2))
    torch.cuda.synchronize(); torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    from megatron.core.tensor_parallel import random as mr
    tracker = mr.get_cuda_rng_tracker(); tracker.add("t", 11)
    with tracker.fork("t"):
        f1 = torch.rand(3)
    tracker2 = mr.CudaRNGStatesTracker(); tracker2.add("t", 11)
    with tracker2.fork("t"):
        f2 = torch.rand(3)
    assert torch.equal(f1, f2)
    print("SHIM-OK")
    """
)


@pytest.mark.megatron
def test_cpu_shim_rewrites_cuda_and_is_idempotent(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the shim refuses to run where CUDA exists")
    proc = subprocess.run([sys.executable, "-c", SHIM_CHECK], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "SHIM-OK" in proc.stdout, proc.stderr[-3000:]


def test_rows_put_each_response_token_after_its_own_prompt():
    from megatron_sdpo.backends.megatron.batching import build_rows, seq_len

    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    S = seq_len(prompts, responses, multiple=4)
    assert S == 8
    rows = build_rows(prompts, responses, T=3, S=S, pad_id=0, device=torch.device("cpu"))
    assert rows.tokens.tolist() == [[5, 6, 7, 1, 2, 0, 0, 0], [8, 3, 4, 9, 0, 0, 0, 0]]
    # Column predicting response token j is len(prompt) + j - 1; past the end it is clamped.
    assert rows.gather_index.tolist() == [[2, 3, 4], [0, 1, 2]]
    assert rows.targets.tolist() == [[1, 2, 0], [3, 4, 9]]
    picked = rows.tokens.gather(1, rows.gather_index + 1)
    assert picked[0, :2].tolist() == [1, 2] and picked[1].tolist() == [3, 4, 9]
    assert rows.packed is None
    assert all(
        t.device.type == "cpu" and t.dtype == torch.long
        for t in (rows.tokens, rows.positions, rows.gather_index, rows.targets)
    )


def test_fp8_rounds_each_ranks_share_of_the_sequence_to_16():
    from megatron_sdpo.backends.megatron.batching import seq_len, seq_multiple

    assert seq_multiple(1, False, fp8=False) == 1 and seq_multiple(4, True, fp8=False) == 4
    assert seq_multiple(1, False, fp8=True) == 16 and seq_multiple(2, False, fp8=True) == 16
    # Under sequence parallelism each TP rank holds S / tp tokens: that share must be a multiple of 16.
    assert seq_multiple(2, True, fp8=True) == 32
    assert seq_len([[1] * 5], [[2] * 12], multiple=16) == 32
    assert seq_len([[1] * 5], [[2] * 11], multiple=16) == 16


def test_micro_batches():
    from megatron_sdpo.backends.megatron.batching import micro_batches

    assert micro_batches([0, 1, 2], 2, equal=False) == [[0, 1], [2]]
    assert micro_batches([0, 1, 2], 2, equal=True) == [[0, 1], [2, -1]]
