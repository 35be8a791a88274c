"""Benchmark the fused linear KL: peak memory and time of forward + backward, per implementation.

Every case (implementation, N) runs in a fresh subprocess so that one case's allocator
high-water mark cannot leak into the next; with --rounds R each case runs R times, the
implementations of one N interleaved (bench_harness.Bench.run). Peak memory is the extra memory
of forward + backward over the inputs (bench_harness.PeakMemory):
  CPU:  peak RSS (getrusage high-water mark) minus the RSS after the inputs were built;
        tracemalloc cannot see torch's allocations.
  CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() after the inputs were built.
Time is the wall time of forward + backward (CUDA: after one warm-up, median of --repeats, synced).
Metrics: peak_mem_bytes, time_s, cpu_time_s (CPU); params N, H, V, dtype, device; the
bench_harness CSV schema (`--out`, and its .summary.csv with ratios against `reference`, and
megatron_fused against megatron_logits).

Implementations: reference (materializes [N, V]), chunked, triton (CUDA), liger (Liger's Triton
fused linear JSD, CUDA), liger_chunked (Liger's plain-torch chunked JSD loss; a CPU peer).
The megatron backend's two ways to fill "fused_kl", side by side (TP=1, one process):
megatron_logits (output layer -> [N, V] logits of student and teacher -> the vocab-parallel
JSD, kernel.fused_kl=false's shard path) and megatron_fused (final hidden states + LM heads ->
fused_linear_kl, what kernel.fused_kl=true runs).

    python tools/bench_kl.py --impls megatron_logits,megatron_fused --tokens 256,1024 --out mcore.csv

    python tools/bench_kl.py --out bench_kl.csv                      # CPU defaults
    python tools/bench_kl.py --device cuda --hidden 4096 --dtype bfloat16 \
        --impls reference,chunked,triton,liger --tokens 1024,4096,8192,16384 --out gpu.csv
"""

from __future__ import annotations

import argparse
import os
import sys

from bench_harness import Bench, NoResult, PeakMemory, median, print_summary, run_child, timed, write_result

UNITS = {"peak_mem_bytes": "B", "time_s": "s", "cpu_time_s": "s"}
# The arm each implementation's ratios are taken against: the path it replaces.
BASELINE = {"megatron_logits": "megatron_logits", "megatron_fused": "megatron_logits"}


def _loss_fn(impl: str, alpha: float):
    import torch

    from megatron_sdpo_kernels import fused_linear_kl

    if impl in ("reference", "chunked", "triton"):
        return lambda hs, ht, ws, wt: fused_linear_kl(hs, ht, ws, wt, alpha=alpha, impl=impl)
    if impl == "megatron_logits":
        from megatron_sdpo.backends import vocab_parallel as vp

        def logits_path(hs, ht, ws, wt):
            # As the backend: output layer in the model dtype, fp32 logits, teacher without grad.
            s = (hs @ ws.t()).float()
            with torch.no_grad():
                t = (ht @ wt.t()).float()
            return vp.generalized_jsd(s, t, alpha, None)

        return logits_path
    if impl == "megatron_fused":
        return lambda hs, ht, ws, wt: fused_linear_kl(hs, ht, ws, wt, alpha=alpha, impl="auto")
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        mod = LigerFusedLinearJSD(jsd_beta=alpha)
        # Liger returns the mean over tokens; scale to a sum so the backward work is comparable.
        return lambda hs, ht, ws, wt: mod(hs, ws, ht, wt, None) * hs.shape[0]
    if impl == "liger_chunked":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        mod = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=alpha, compiled=False)
        return lambda hs, ht, ws, wt: mod(hs, ws, ht, wt, torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device))
    raise SystemExit(f"error: unknown impl {impl!r}")


def run_case(impl: str, n: int, h: int, v: int, dtype: str, device: str, alpha: float, repeats: int) -> dict:
    """Run one case in this process and return its measurements."""
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    dev = torch.device(device)
    hs = torch.randn(n, h, device=dev, dtype=dt).requires_grad_(True)
    ht = torch.randn(n, h, device=dev, dtype=dt)
    ws = (torch.randn(v, h, device=dev, dtype=dt) * h**-0.5).requires_grad_(True)
    wt = torch.randn(v, h, device=dev, dtype=dt) * h**-0.5
    fn = _loss_fn(impl, alpha)

    def step():
        hs.grad = None
        ws.grad = None
        loss = fn(hs, ht, ws, wt)
        loss.sum().backward()

    if dev.type == "cuda":
        step()  # compile / autotune outside the measurement
        with PeakMemory(dev) as peak:
            times = [timed(step, cuda=True)[0] for _ in range(repeats)]
        return {"peak_mem_bytes": peak.bytes, "time_s": median(times)}

    # Warm up on tiny inputs first: lazily loaded BLAS code and thread pools would otherwise be
    # counted as the kernel's memory.
    tiny = [t[:8].detach().clone().requires_grad_(t.requires_grad) for t in (hs, ht)]
    tiny_w = [t[:64].detach().clone().requires_grad_(t.requires_grad) for t in (ws, wt)]
    fn(tiny[0], tiny[1], tiny_w[0], tiny_w[1]).sum().backward()
    del tiny, tiny_w
    with PeakMemory(dev) as peak:
        elapsed, cpu = timed(step)
    note = "" if peak.exact else "peak below the import-time high-water mark (upper bound)"
    return {"peak_mem_bytes": (peak.bytes, note), "time_s": elapsed, "cpu_time_s": cpu}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="reference,chunked")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3, help="CUDA: timed steps per case and round (median)")
    ap.add_argument("--rounds", type=int, default=1, help="fresh-process runs of every case, interleaved")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument(
        "--max-ref-bytes",
        type=float,
        default=None,
        help="skip 'reference' when its estimated peak exceeds this (default: 80%% of free memory)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default="bench_kl.csv")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.case:  # child mode: one measurement, handed back to run_child
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        impl, n = args.case.split(",")
        res = run_case(impl, int(n), args.hidden, args.vocab, args.dtype, args.device, args.alpha, args.repeats)
        write_result(args.result, res)
        return

    limit = args.max_ref_bytes
    if limit is None and args.device == "cpu":
        import psutil

        limit = 0.8 * psutil.virtual_memory().available

    def case(impl: str, n: int):
        def measure() -> dict:
            # Measured on CPU: the reference peaks at about ten fp32 [N, V] tensors.
            est = 10 * 4 * n * args.vocab
            if impl in ("reference", "megatron_logits") and limit is not None and est > limit:
                raise NoResult("skipped", f"estimated {est / 2**30:.1f} GiB exceeds {limit / 2**30:.1f} GiB")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--case",
                f"{impl},{n}",
                "--hidden",
                str(args.hidden),
                "--vocab",
                str(args.vocab),
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--alpha",
                str(args.alpha),
                "--repeats",
                str(args.repeats),
            ]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            return run_child(cmd, timeout=args.timeout)[0]

        return measure

    bench = Bench("kl", units=UNITS, out=args.out, baseline=lambda impl: BASELINE.get(impl, "reference"))
    impls = args.impls.split(",")
    for n in [int(x) for x in args.tokens.split(",")]:
        bench.run(
            {impl: case(impl, n) for impl in impls},
            rounds=args.rounds,
            params={"N": n, "H": args.hidden, "V": args.vocab, "dtype": args.dtype, "device": args.device},
        )
    summary = bench.write()
    print_summary(summary)
    for s in summary:
        if s["metric"] == "peak_mem_bytes" and s["ratio"] and s["arm"] != s["baseline"]:
            n = s["params"].split(";")[0]
            print(f"{n}: {s['arm']} / {s['baseline']} peak memory = {s['ratio']:.4f} (1/{1 / s['ratio']:.1f})")


if __name__ == "__main__":
    main()
