"""Benchmark the fused linear KL: peak memory and time of forward + backward, one CSV row per case.

Every case runs in a fresh subprocess so that one case's allocator high-water mark cannot leak
into the next. Peak memory is the extra memory of forward + backward over the inputs:
  CPU:  peak RSS (getrusage high-water mark) minus the RSS after the inputs were built;
        tracemalloc cannot see torch's allocations.
  CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() after the inputs were built.
Time is the wall time of forward + backward (CUDA: after one warm-up, median of --repeats, synced).

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
import csv
import json
import os
import resource
import subprocess
import sys
import time

FIELDS = ["impl", "N", "H", "V", "dtype", "device", "peak_mem_bytes", "time_s", "cpu_time_s", "note"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _loss_fn(impl: str, alpha: float):
    import torch

    from megatron_sdpo.kernels import fused_linear_kl

    if impl in ("reference", "chunked", "triton"):
        return lambda hs, ht, ws, wt: fused_linear_kl(hs, ht, ws, wt, alpha=alpha, impl=impl)
    if impl == "megatron_logits":
        from megatron_sdpo.backends.megatron import vocab_parallel as vp

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
        return lambda hs, ht, ws, wt: mod(
            hs, ws, ht, wt, torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device)
        )
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
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated() - base
        return {"peak_mem_bytes": int(peak), "time_s": sorted(times)[len(times) // 2]}

    # Warm up on tiny inputs first: lazily loaded BLAS code and thread pools would otherwise be
    # counted as the kernel's memory.
    tiny = [t[:8].detach().clone().requires_grad_(t.requires_grad) for t in (hs, ht)]
    tiny_w = [t[:64].detach().clone().requires_grad_(t.requires_grad) for t in (ws, wt)]
    fn(tiny[0], tiny[1], tiny_w[0], tiny_w[1]).sum().backward()
    del tiny, tiny_w
    base = _rss_bytes()
    before_peak = _peak_rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    after_peak = _peak_rss_bytes()
    note = "" if after_peak > before_peak else "peak below the import-time high-water mark (upper bound)"
    return {"peak_mem_bytes": max(0, after_peak - base), "time_s": elapsed, "cpu_time_s": cpu, "note": note}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="reference,chunked")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--max-ref-bytes", type=float, default=None,
                    help="skip 'reference' when its estimated peak exceeds this (default: 80%% of free memory)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default="bench_kl.csv")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.case:  # child mode: one measurement, printed as JSON
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        impl, n = args.case.split(",")
        res = run_case(impl, int(n), args.hidden, args.vocab, args.dtype, args.device, args.alpha, args.repeats)
        print("RESULT " + json.dumps(res))
        return

    limit = args.max_ref_bytes
    if limit is None and args.device == "cpu":
        import psutil

        limit = 0.8 * psutil.virtual_memory().available
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        for impl in args.impls.split(","):
            row = {"impl": impl, "N": n, "H": args.hidden, "V": args.vocab, "dtype": args.dtype,
                   "device": args.device, "peak_mem_bytes": "", "time_s": "", "cpu_time_s": "", "note": ""}
            # Measured on CPU: the reference peaks at about ten fp32 [N, V] tensors.
            est = 10 * 4 * n * args.vocab
            if impl in ("reference", "megatron_logits") and limit is not None and est > limit:
                row["note"] = f"skipped: estimated {est / 2**30:.1f} GiB exceeds {limit / 2**30:.1f} GiB"
            else:
                cmd = [sys.executable, os.path.abspath(__file__), "--case", f"{impl},{n}",
                       "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype,
                       "--device", args.device, "--alpha", str(args.alpha), "--repeats", str(args.repeats)]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                    if proc.returncode == 0 and lines:
                        row.update(json.loads(lines[-1][len("RESULT "):]))
                    else:
                        row["note"] = "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                except subprocess.TimeoutExpired:
                    row["note"] = f"timed out after {args.timeout:.0f} s"
            rows.append(row)
            print(",".join(str(row[k]) for k in FIELDS), flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    by = {(r["impl"], r["N"]): r["peak_mem_bytes"] for r in rows}
    for n in sorted({r["N"] for r in rows}):
        for full, fused in (("reference", "chunked"), ("megatron_logits", "megatron_fused")):
            ref, chk = by.get((full, n)), by.get((fused, n))
            if ref and chk:
                print(f"N={n}: {fused} / {full} peak memory = {chk / ref:.4f} (1/{ref / chk:.1f})")


if __name__ == "__main__":
    main()
