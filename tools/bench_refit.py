"""Refit cost: HF-named policy tensors from a backend's export into the colocated vLLM engine,
in layer-aligned buckets, in one process.

    python tools/bench_refit.py [--buckets 65536,262144,1048576,67108864] [--repeats 5]

Uses the shipped tiny base and the HF backend's export. Prints, per bucket size, the number of
buckets, the best-of-repeats total refit time and the mean time per bucket (export + checksum
+ the engine's in-place reload of that bucket).
"""
from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", default="65536,262144,1048576,67108864")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.models.tiny import ensure_tiny_base
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    path = ensure_tiny_base()
    backend = HFBackend(path, lr=1e-4, micro_batch_size=8)
    with tempfile.TemporaryDirectory() as run_dir:
        engine = VLLMRolloutEngine(path, max_model_len=128, max_num_seqs=8, run_dir=run_dir)
        print("bucket_bytes,buckets,refit_s,per_bucket_s,mbytes")
        for size in (int(x) for x in args.buckets.split(",")):
            engine.bucket_bytes = size
            best = None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                engine.update_weights(backend.export_weights())
                total = time.perf_counter() - t0
                if best is None or total < best[0]:
                    best = (total, dict(engine.last_sync))
            total, sync = best
            print(f"{size},{sync['sync_buckets']:.0f},{total:.4f},{sync['sync_bucket_time_mean']:.4f},{sync['sync_bytes'] / 1e6:.2f}")


if __name__ == "__main__":
    main()
