"""HFBackend under torch DDP (gloo, 2 spawned processes) gives world-1 results.

Seven samples split 4 / 3 over the ranks and 2-sample micro-batches: loss, grad norm, the
gradient (Adam's first moment) and gathered logprobs must match a single process. Then two steps
with rows without signal skipped (algorithms/signal_rows.py): one row with signal (the other rank
runs a placeholder) and none (both do): no rank hangs in the gradient all-reduce, and the steps
match the single process's.
"""

import faulthandler
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3
from megatron_sdpo.trainer import minibatch_update

from backend_losses import WeightedNLL

TIMEOUT_S = 240


def make_batch(seed: int, B: int = 7) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, 9, (B,), generator=g).tolist()
    r_len = torch.randint(1, 7, (B,), generator=g).tolist()
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in p_len]
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in r_len]
    mask = torch.zeros(B, max(r_len))
    for i, n in enumerate(r_len):
        mask[i, :n] = 1.0
    return SequenceBatch(prompts, responses, None, {"loss_mask": mask, "advantages": torch.randn(B, generator=g)})


def run_backend(model_dir: str, micro_batch_size: int) -> dict:
    from megatron_sdpo.backends.hf import HFBackend

    backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=micro_batch_size, grad_clip=1e9)
    batch = make_batch(0)
    logprobs = backend.logprobs(batch)
    metrics = backend.train_step(batch, WeightedNLL())
    moments = {k: backend.optimizer.state[p]["exp_avg"].clone() for k, p in backend.policy.named_parameters()}
    params = {k: v.detach().clone() for k, v in backend.policy.state_dict().items()}
    skipped = []
    for signal_rows in ([3], []):
        b = make_batch(1)
        keep = torch.zeros(len(b))
        keep[signal_rows] = 1.0
        b.tensors["advantages"] = b.tensors["advantages"] * keep
        skipped.append(minibatch_update(backend, b, WeightedNLL(), mini_batches=1, group_size=1, skip=True))
    after = {k: v.detach().clone() for k, v in backend.policy.state_dict().items()}
    return {
        "metrics": metrics,
        "logprobs": logprobs,
        "moments": moments,
        "params": params,
        "skipped": skipped,
        "after": after,
    }


def _worker(rank: int, world: int, model_dir: str, init_file: str, out_dir: str) -> None:
    faulthandler.dump_traceback_later(TIMEOUT_S - 30, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = run_backend(model_dir, micro_batch_size=2)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_world2_matches_world1(tmp_path, assert_adam_first_step_close):
    model_dir = save_tiny_qwen3(tmp_path / "tiny", seed=5)
    ctx = mp.start_processes(
        _worker,
        args=(2, model_dir, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"DDP workers did not finish within {TIMEOUT_S} s")

    single = run_backend(model_dir, micro_batch_size=3)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-5)
        assert r["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-4)
        assert r["metrics"]["tokens"] == single["metrics"]["tokens"]
        torch.testing.assert_close(r["logprobs"], single["logprobs"], atol=1e-5, rtol=0)
        for k, m in single["moments"].items():
            torch.testing.assert_close(r["moments"][k], m, atol=1e-5 * float(m.abs().max()), rtol=1e-4)
        for k, p in single["params"].items():
            # Adam's first step is ~lr * sign(g), amplifying the gradients' rounding where |g| is
            # near eps: bounded by the gradient difference (derivation in tests/conftest.py).
            # exp_avg = (1 - beta1) * g after one step.
            g_r, g_1 = r["moments"][k] / 0.1, single["moments"][k] / 0.1
            assert_adam_first_step_close(r["params"][k], p, g_r, g_1, lr=1e-3, what=k)
        for got, want in zip(r["skipped"], single["skipped"], strict=True):
            assert got["train/rows_skipped"] == want["train/rows_skipped"]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-12)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4, abs=1e-12)
    assert [m["train/rows_skipped"] for m in single["skipped"]] == [6.0, 7.0]
    assert single["skipped"][0]["grad_norm"] > 0 and single["skipped"][1]["grad_norm"] == 0.0
    # DDP keeps the replicas identical.
    for k in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k])
        assert torch.equal(ranks[0]["after"][k], ranks[1]["after"][k])
