"""Rollout time: colocated vLLM vs HF generate, side by side in one process.

    python tools/bench_rollout.py --out bench_rollout.csv [--workload loop,fixed --engines vllm,hf]

Two workloads on the shipped tiny base (megatron_sdpo/assets/tiny_base; a random tiny Qwen3 of
the same shape where it is missing, `loop` then needs the shipped tokenizer):
- `loop`: what `run tiny` does every step: the tiny preset's first-stage prompts (16 math
  training prompts, chat template, the domain's worked examples), 8 samples each at the
  preset's rollout temperature and top-p, EOS on, `--loop-new-tokens` (the tiny
  preset's 32) at most, texts decoded, and a weight refit before every generate. The engines
  alternate within each repeat (order flipped every repeat) so a busy machine slows both alike;
  the CSV has the median over repeats after the first two, and the vLLM / HF ratio is printed.
  `--preset smollm2_135m --workload loop` runs the same on that preset's model and prompts
  (`--loop-new-tokens 48 --prompts 8 --n 4` is its step).
- `fixed`: random prompts with EOS disabled, so every sample runs to exactly max_new_tokens for
  each of `--new-tokens` and both engines do the same work (best of `--repeats`).
Writes one CSV row per (workload, engine, max_new_tokens) and <out>.startup.csv with start-up
and first-call times. Set OMP_NUM_THREADS the same way for every comparison.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
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


def loop_prompts(cfg, path: str, num: int, seed: int):
    """The preset's first-stage prompts (its data source: wording, difficulty), encoded as the
    trainer encodes them, and the tokenizer."""
    import dataclasses

    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.chat import record_prompts
    from megatron_sdpo.data.sources import load_source

    domain = cfg.stages[0].domain
    tok = load_tokenizer(path)
    source = dataclasses.replace(cfg.domains[domain].train, n=num)
    records = load_source(source, domain, "train", seed=seed, shots=cfg.domains[domain].shots)
    return record_prompts(tok, records), tok


def bench_loop(args, path: str, work: Path, startup: list[dict]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from megatron_sdpo.rollout import SamplingConfig, make_engine

    prompts, tok = loop_prompts(args.cfg, path, args.prompts, args.seed)
    # The same settings the trainer's engines get (builders.make_rollout).
    common = dict(seed=args.seed, max_model_len=args.cfg.rollout.max_model_len,
                  eos_token_ids=[tok.eos_token_id], detokenize=True)
    extra = {
        "vllm": {"run_dir": str(work / "vllm_run"), "max_num_seqs": args.prompts * args.n,
                 "enforce_eager": args.cfg.rollout.enforce_eager},
        "hf": {"pad_token_id": tok.pad_token_id, "max_batch_size": 256},
    }
    engines = {}
    for kind in args.engines.split(","):
        t0 = time.perf_counter()
        engines[kind] = make_engine(kind, model_path=path, **common, **extra[kind])
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engines[kind].generate(prompts, SamplingConfig(n=args.n, max_new_tokens=args.loop_new_tokens, seed=0))
        startup.append({"engine": kind, "startup_s": round(start_s, 3), "first_generate_s": round(time.perf_counter() - t0, 3)})
    policy = AutoModelForCausalLM.from_pretrained(path)  # the trainer's side of the refit
    times = {k: {"generate": [], "refit": [], "tokens": []} for k in engines}
    for rep in range(args.loop_repeats + 2):
        # The preset's sampling, as its trainer rolls out (smollm2_135m samples at 0.7).
        cfg = SamplingConfig(n=args.n, temperature=args.cfg.rollout.temperature, top_p=args.cfg.rollout.top_p,
                             max_new_tokens=args.loop_new_tokens, seed=rep)
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for kind in order:
            e = engines[kind]
            t0 = time.perf_counter()
            e.update_weights((k, v.detach()) for k, v in policy.state_dict().items())
            t1 = time.perf_counter()
            comps = e.generate(prompts, cfg)
            t2 = time.perf_counter()
            if rep >= 2:  # the first two repeats warm up both engines
                times[kind]["refit"].append(t1 - t0)
                times[kind]["generate"].append(t2 - t1)
                times[kind]["tokens"].append(sum(len(c.token_ids) for c in comps))
    rows = []
    for kind, t in times.items():
        gen_s = statistics.median(t["generate"])
        tokens = statistics.median(t["tokens"])
        rows.append({
            "workload": "loop", "engine": kind, "prompts": args.prompts, "n": args.n,
            "max_new_tokens": args.loop_new_tokens, "generated_tokens": tokens, "seconds": round(gen_s, 4),
            "tokens_per_s": round(tokens / gen_s, 1), "refit_s": round(statistics.median(t["refit"]), 4),
        })
        print(f"loop  {kind:5s} tokens={tokens:7.1f} generate {gen_s:7.3f} s  refit {rows[-1]['refit_s']:.4f} s (medians of {len(t['generate'])})")
    if {"vllm", "hf"} <= set(times):
        ratios = [v / h for v, h in zip(times["vllm"]["generate"], times["hf"]["generate"])]
        print(f"loop: vLLM / HF generate time = {statistics.median(ratios):.2f}x (median of per-repeat ratios; "
              f"min {min(ratios):.2f}, max {max(ratios):.2f})")
    return rows


def bench_fixed(args, path: str, work: Path, startup: list[dict]) -> list[dict]:
    from megatron_sdpo.rollout import SamplingConfig, make_engine

    lengths = [int(x) for x in args.new_tokens.split(",")]
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab, args.seed)
    max_len = max(len(p) for p in prompts) + max(lengths) + 1
    rows = []
    for kind in args.engines.split(","):
        extra = {"run_dir": str(work / "vllm_run_fixed"), "max_num_seqs": args.prompts * args.n} if kind == "vllm" else {}
        t0 = time.perf_counter()
        engine = make_engine(kind, model_path=path, seed=args.seed, max_model_len=max_len, eos_token_ids=[], **extra)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(prompts[:2], SamplingConfig(n=2, max_new_tokens=4))  # first call: lazy init
        startup.append({"engine": f"{kind} (fixed)", "startup_s": round(start_s, 3), "first_generate_s": round(time.perf_counter() - t0, 3)})
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
            rows.append({
                "workload": "fixed", "engine": kind, "prompts": args.prompts, "n": args.n, "max_new_tokens": new,
                "generated_tokens": tokens, "seconds": round(best, 4), "tokens_per_s": round(tokens / best, 1), "refit_s": "",
            })
            print(f"fixed {kind:5s} new={new:4d} tokens={tokens:6d} {best:8.3f} s {tokens / best:10.1f} tok/s")
        del engine
    by = {(r["engine"], r["max_new_tokens"]): r["tokens_per_s"] for r in rows}
    for new in lengths:
        if ("vllm", new) in by and ("hf", new) in by:
            print(f"fixed max_new_tokens={new}: vLLM / HF throughput = {by['vllm', new] / by['hf', new]:.2f}x")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_rollout.csv")
    ap.add_argument("--workload", default="loop,fixed", help="comma list of loop, fixed")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", default="8,32,128", help="fixed workload lengths")
    ap.add_argument("--repeats", type=int, default=2, help="fixed workload: best of")
    ap.add_argument("--loop-new-tokens", type=int, default=32)
    ap.add_argument("--loop-repeats", type=int, default=10, help="loop workload: timed repeats (median)")
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="tiny",
                    help="loop workload: the preset whose model and first-stage prompts to use "
                         "(e.g. smollm2_135m; the fixed workload always uses the tiny base)")
    args = ap.parse_args()
    workloads = args.workload.split(",")
    if set(workloads) - {"loop", "fixed"} or set(args.engines.split(",")) - {"vllm", "hf"}:
        ap.error("--workload takes loop,fixed and --engines vllm,hf")

    from megatron_sdpo.builders import resolve_model_path
    from megatron_sdpo.config import load_config

    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    args.cfg = load_config(args.preset)
    if args.preset != "tiny" and "fixed" in workloads:
        ap.error("--preset applies to the loop workload only: pass --workload loop")
    path = model_dir(work) if args.preset == "tiny" else resolve_model_path(args.cfg)
    print(f"model {path}  torch threads {torch.get_num_threads()}  prompts {args.prompts} x n {args.n}")
    rows: list[dict] = []
    startup: list[dict] = []
    if "loop" in workloads:
        rows += bench_loop(args, path, work, startup)
    if "fixed" in workloads:
        rows += bench_fixed(args, path, work, startup)

    out = Path(args.out)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with out.with_suffix(".startup.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(startup[0]))
        w.writeheader()
        w.writerows(startup)
    print(f"wrote {out} and {out.with_suffix('.startup.csv')}")


if __name__ == "__main__":
    main()
