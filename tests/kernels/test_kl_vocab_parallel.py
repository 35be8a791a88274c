"""Vocab-parallel fused KL / logprobs at TP=2 over gloo equal the unsharded reference (the
specification of algorithms/divergence.py on materialized logits)."""

import faulthandler
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
TP = 2
V = 1030  # divisible by TP (Megatron requires it), 515 rows per rank: no tile multiple
TIMEOUT_S = 180
UNEVEN = 700  # rank 0's rows in the unequal split (rank 1: V - UNEVEN)


def _worker(rank: int, world: int, store_file: str, out_dir: str) -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(TIMEOUT_S - 20, exit=True)
    sys.path.insert(0, str(HERE))
    import torch.distributed as dist

    from megatron_sdpo_kernels import ChunkSizes, fused_linear_kl, fused_linear_logprobs

    from kl_cases import grads_of, make_inputs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        vl = V // world
        rows = slice(rank * vl, (rank + 1) * vl)
        chunks = ChunkSizes(16, 100)
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            x = make_inputs(v=V, dtype=dtype)
            ws_shard, wt_shard = x["ws"][rows], x["wt"][rows]
            for alpha in (0.0, 0.5, 1.0):
                for name, impl, grp, ws, wt in (
                    ("ref", "reference", None, x["ws"], x["wt"]),
                    ("tp", "chunked", group, ws_shard, wt_shard),
                ):
                    fn = lambda hs, w, x=x, wt=wt, alpha=alpha, impl=impl, grp=grp: fused_linear_kl(
                        hs,
                        x["ht"],
                        w,
                        wt,
                        alpha=alpha,
                        temperature=0.7,
                        mask=x["mask"],
                        impl=impl,
                        tp_group=grp,
                        chunk_sizes=chunks,
                    )
                    results[(str(dtype), "kl", alpha, name)] = grads_of(fn, x["hs"], ws, x["go"])
            g2 = torch.linspace(-1.0, 2.0, x["hs"].shape[0])
            for name, impl, grp, ws in (("ref", "reference", None, x["ws"]), ("tp", "chunked", group, ws_shard)):
                fn = lambda h, w, x=x, impl=impl, grp=grp: fused_linear_logprobs(
                    h, w, x["labels"], temperature=1.3, mask=x["mask"], impl=impl, tp_group=grp, chunk_sizes=chunks
                )
                results[(str(dtype), "lp", None, name)] = grads_of(fn, x["hs"], ws, x["go"], g2)
            # Unequal shards (a padded vocabulary cut at its real size): explicit first ids.
            cut = slice(0, UNEVEN) if rank == 0 else slice(UNEVEN, V)
            fn = lambda h, w, x=x, cut=cut: fused_linear_logprobs(
                h,
                w,
                x["labels"],
                temperature=1.3,
                mask=x["mask"],
                impl="chunked",
                tp_group=group,
                chunk_sizes=chunks,
                shard_start=cut.start,
                vocab_size=V,
            )
            results[(str(dtype), "lp_uneven", None, "uneven")] = grads_of(fn, x["hs"], x["ws"][cut], x["go"], g2)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _assert_rank_matches(key: tuple, r: int, got: tuple, ref: tuple, rows: slice) -> None:
    """Rank r's outputs and dh (`got`) against the unsharded run's (`ref`), its dw against the
    reference's `rows` (the rank's shard of the vocabulary)."""
    tol_grad = dict(rtol=2e-5, atol=2e-5) if key[0] == "torch.float32" else dict(rtol=2e-2, atol=2e-3)
    (outs, dh, dw), (outs_ref, dh_ref, dw_ref) = got, ref
    for o, o_ref in zip(outs, outs_ref, strict=True):
        torch.testing.assert_close(o, o_ref, rtol=2e-5, atol=2e-5, msg=lambda m: f"{key} rank {r}: {m}")
    torch.testing.assert_close(dh, dh_ref, **tol_grad, msg=lambda m: f"{key} rank {r} dh: {m}")
    torch.testing.assert_close(dw, dw_ref[rows], **tol_grad, msg=lambda m: f"{key} rank {r} dw: {m}")


@pytest.mark.distributed
def test_vocab_parallel_tp2_equals_unsharded(tmp_path):
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, TP, str(tmp_path / "store"), str(tmp_path))) for r in range(TP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a TP rank hung (see its faulthandler dump above)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    vl = V // TP
    keys = [k for k in res[0] if k[-1] == "tp"]
    assert len(keys) == 8
    for key in keys:
        for r in range(TP):
            _assert_rank_matches(key, r, res[r][key], res[0][key[:-1] + ("ref",)], slice(r * vl, (r + 1) * vl))
        # Every rank ends with the same bits: statistics are combined in rank order, then all-reduced.
        for i in range(len(res[0][key][0])):
            assert torch.equal(res[0][key][0][i], res[1][key][0][i]), f"{key}: ranks disagree"
    for dtype in ("torch.float32", "torch.bfloat16"):
        key = (dtype, "lp_uneven", None, "uneven")
        for r, rows in enumerate((slice(0, UNEVEN), slice(UNEVEN, V))):
            _assert_rank_matches(key, r, res[r][key], res[0][(dtype, "lp", None, "ref")], rows)
