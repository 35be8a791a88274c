"""Refit cost: HF-named policy tensors from a backend's export into the colocated vLLM engine,
in layer-aligned buckets, in one process.

    python tools/bench_refit.py [--buckets 65536,262144,1048576,67108864] [--rounds 5] [--out bench_refit.csv]

Uses the shipped tiny base and the HF backend's export. One arm per bucket size (bucket_<bytes>),
interleaved over --rounds after one untimed round (--repeats is the same flag;
bench_harness.Bench.run); metrics per round: refit_s (the total refit), buckets, per_bucket_s
(the mean time per bucket: export + checksum + the engine's in-place reload of that bucket) and
mbytes, in the bench_harness CSV schema. Prints, per bucket size, the median and the best (min)
over rounds and the ratio to the largest bucket.
"""

from __future__ import annotations

import argparse
import tempfile

from bench_harness import Bench, print_summary, timed

UNITS = {"refit_s": "s", "per_bucket_s": "s", "mbytes": "MB"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", default="65536,262144,1048576,67108864")
    ap.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=5)
    ap.add_argument("--out", default="bench_refit.csv")
    args = ap.parse_args()
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.models.tiny import ensure_tiny_base
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    sizes = [int(x) for x in args.buckets.split(",")]
    path = ensure_tiny_base()
    backend = HFBackend(path, lr=1e-4, micro_batch_size=8)
    with tempfile.TemporaryDirectory() as run_dir:
        engine = VLLMRolloutEngine(path, max_model_len=128, max_num_seqs=8, run_dir=run_dir)

        def arm(size: int):
            def measure() -> dict:
                engine.bucket_bytes = size
                total, _ = timed(lambda: engine.update_weights(backend.export_weights()))
                sync = engine.last_sync
                return {
                    "refit_s": total,
                    "buckets": sync["sync_buckets"],
                    "per_bucket_s": sync["sync_bucket_time_mean"],
                    "mbytes": sync["sync_bytes"] / 1e6,
                }

            return measure

        bench = Bench("refit", units=UNITS, out=args.out, baseline=f"bucket_{max(sizes)}")
        bench.run(
            {f"bucket_{size}": arm(size) for size in sizes}, rounds=args.rounds, warmup=1, params={"model": "tiny_base"}
        )
        print_summary(bench.write(), metrics=("refit_s", "per_bucket_s", "buckets"))


if __name__ == "__main__":
    main()
