"""Rollout throughput: colocated vLLM vs HF generate on the same workload, in one process.

    python tools/bench_rollout.py --out bench_rollout.csv [--prompts 16 --n 8 --new-tokens 8,32,128]

Uses the shipped tiny base (megatron_sdpo/assets/tiny_base) when present, else a random tiny
Qwen3 of the same shape. EOS is disabled so every sample generates exactly max_new_tokens and
both engines do the same work. Writes one CSV row per (engine, max_new_tokens) with the best of
--repeats timed runs, a <out>.startup.csv with engine start-up and first-call times, and prints
the vLLM / HF throughput ratio per length.
"""
from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

import torch

TINY_BASE_SHAPE = dict(num_hidden_layers=4, intermediate_size=384, vocab_size=659, max_position_embeddings=1024)


def model_dir(work: Path) -> str:
    import megatron_sdpo

    shipped = Path(megatron_sdpo.__file__).parent / "assets" / "tiny_base"
    if (shipped / "config.json").is_file():
        return str(shipped)
    from megatron_sdpo.backends.tiny import save_tiny_qwen3

    return save_tiny_qwen3(work / "tiny_qwen3", seed=0, **TINY_BASE_SHAPE)


def make_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_rollout.csv")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", default="8,32,128")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from megatron_sdpo.rollout import SamplingConfig, make_engine

    lengths = [int(x) for x in args.new_tokens.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    path = model_dir(work)
    import json

    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab, args.seed)
    max_len = max(len(p) for p in prompts) + max(lengths) + 1
    print(f"model {path}  torch threads {torch.get_num_threads()}  prompts {args.prompts} x n {args.n}")

    rows, startup = [], []
    for kind in args.engines.split(","):
        extra = {"run_dir": str(work / "vllm_run"), "max_num_seqs": args.prompts * args.n} if kind == "vllm" else {}
        t0 = time.perf_counter()
        engine = make_engine(kind, model_path=path, seed=args.seed, max_model_len=max_len, eos_token_ids=[], **extra)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(prompts[:2], SamplingConfig(n=2, max_new_tokens=4))  # first call: lazy init
        first_s = time.perf_counter() - t0
        startup.append({"engine": kind, "startup_s": round(start_s, 3), "first_generate_s": round(first_s, 3)})
        print(f"{kind}: start-up {start_s:.1f} s, first call {first_s:.2f} s")
        for new in lengths:
            cfg = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=new)
            best, tokens = float("inf"), 0
            # One untimed call at the exact workload: vLLM's CPU path warms up per batch shape
            # (seconds), which is start-up cost, not throughput.
            engine.generate(prompts, cfg)
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                comps = engine.generate(prompts, cfg)
                best = min(best, time.perf_counter() - t0)
                tokens = sum(len(c.token_ids) for c in comps)
            rows.append(
                {
                    "engine": kind,
                    "prompts": args.prompts,
                    "n": args.n,
                    "max_new_tokens": new,
                    "generated_tokens": tokens,
                    "seconds": round(best, 4),
                    "tokens_per_s": round(tokens / best, 1),
                }
            )
            print(f"{kind:5s} new={new:4d} tokens={tokens:6d} {best:8.3f} s {tokens / best:10.1f} tok/s")
        del engine

    out = Path(args.out)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with out.with_suffix(".startup.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(startup[0]))
        w.writeheader()
        w.writerows(startup)
    by = {(r["engine"], r["max_new_tokens"]): r["tokens_per_s"] for r in rows}
    for new in lengths:
        if ("vllm", new) in by and ("hf", new) in by:
            print(f"max_new_tokens={new}: vLLM / HF throughput = {by['vllm', new] / by['hf', new]:.2f}x")
    print(f"wrote {out} and {out.with_suffix('.startup.csv')}")


if __name__ == "__main__":
    main()
