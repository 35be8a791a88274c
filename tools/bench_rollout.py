"""Rollout time: colocated vLLM vs HF generate, side by side in one process.

    python tools/bench_rollout.py --out bench_rollout.csv [--workload loop,fixed --engines vllm,hf]

Two workloads on the shipped tiny base (megatron_sdpo/assets/tiny_base; a random tiny Qwen3 of
the same shape where it is missing, `loop` then needs the shipped tokenizer):
- `loop`: what `run tiny` does every step: the tiny preset's first-stage prompts (16 math
  training prompts, chat template, the domain's worked examples), 8 samples each at the
  preset's rollout temperature and top-p, EOS on, `--loop-new-tokens` (the tiny
  preset's 32) at most, texts decoded, and a weight refit before every generate. The engines
  alternate within each round (bench_harness.Bench.run: order rotated every round) so a busy
  machine slows both alike; `--loop-repeats` rounds are timed after two warm-up rounds, and the
  vLLM / HF ratio (the median of per-round ratios) is printed.
  `--preset smollm2_135m --workload loop` runs the same on that preset's model and prompts
  (`--loop-new-tokens 48 --prompts 8 --n 4` is its step).
- `fixed`: random prompts with EOS disabled, so every sample runs to exactly max_new_tokens for
  each of `--new-tokens` and both engines do the same work, one engine after the other
  (`--repeats` rounds after one untimed round; the summary's min is the old best-of).
Writes the bench_harness CSV schema to --out (arms: the engines; params: workload, prompts, n,
max_new_tokens; metrics generate_s, refit_s (loop), generated_tokens, tokens_per_s, and the
start-up rows startup_s, first_generate_s) and its .summary.csv (medians, ratios to hf). Set
OMP_NUM_THREADS the same way for every comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch
from bench_harness import Bench, parse_params, print_summary, summary_path, timed

UNITS = {
    "generate_s": "s",
    "refit_s": "s",
    "generated_tokens": "tokens",
    "tokens_per_s": "tokens/s",
    "startup_s": "s",
    "first_generate_s": "s",
}
TINY_BASE_SHAPE = dict(num_hidden_layers=4, intermediate_size=384, vocab_size=659, max_position_embeddings=1024)


def model_dir(work: Path) -> str:
    import megatron_sdpo

    shipped = Path(megatron_sdpo.__file__).parent / "assets" / "tiny_base"
    if (shipped / "config.json").is_file():
        return str(shipped)
    from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3

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


def start_engines(bench: Bench, params: dict, kinds: list[str], make, first_call) -> dict:
    """The engines, their start-up and first-call times recorded (round 1: they happen once)."""
    engines = {}
    for kind in kinds:
        start_s, _ = timed(lambda kind=kind: engines.__setitem__(kind, make(kind)))
        first_s, _ = timed(lambda kind=kind: first_call(engines[kind]))
        bench.record(kind, 1, {"startup_s": start_s, "first_generate_s": first_s}, params)
    return engines


def bench_loop(args, path: str, work: Path, bench: Bench) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_sdpo.rollout import SamplingConfig, make_engine

    prompts, tok = loop_prompts(args.cfg, path, args.prompts, args.seed)
    # The same settings the trainer's engines get (builders.make_rollout).
    common = dict(
        seed=args.seed, max_model_len=args.cfg.rollout.max_model_len, eos_token_ids=[tok.eos_token_id], detokenize=True
    )
    extra = {
        "vllm": {
            "run_dir": str(work / "vllm_run"),
            "max_num_seqs": args.prompts * args.n,
            "enforce_eager": args.cfg.rollout.enforce_eager,
        },
        "hf": {"pad_token_id": tok.pad_token_id, "max_batch_size": 256},
    }
    params = {"workload": "loop", "preset": args.preset, "prompts": args.prompts, "n": args.n}
    engines = start_engines(
        bench,
        params,
        args.engines.split(","),
        lambda kind: make_engine(kind, model_path=path, **common, **extra[kind]),
        lambda e: e.generate(prompts, SamplingConfig(n=args.n, max_new_tokens=args.loop_new_tokens, seed=0)),
    )
    policy = AutoModelForCausalLM.from_pretrained(path)  # the trainer's side of the refit

    def arm(kind: str):
        seeds = itertools.count()  # the k-th call of every arm is in the same round: same seed

        def measure() -> dict:
            e = engines[kind]
            # The preset's sampling, as its trainer rolls out (smollm2_135m samples at 0.7).
            cfg = SamplingConfig(
                n=args.n,
                temperature=args.cfg.rollout.temperature,
                top_p=args.cfg.rollout.top_p,
                max_new_tokens=args.loop_new_tokens,
                seed=next(seeds),
            )
            refit_s, _ = timed(lambda: e.update_weights((k, v.detach()) for k, v in policy.state_dict().items()))
            comps = []
            gen_s, _ = timed(lambda: comps.extend(e.generate(prompts, cfg)))
            tokens = sum(len(c.token_ids) for c in comps)
            return {"generate_s": gen_s, "refit_s": refit_s, "generated_tokens": tokens, "tokens_per_s": tokens / gen_s}

        return measure

    # The first two rounds warm up both engines.
    bench.run(
        {kind: arm(kind) for kind in engines},
        rounds=args.loop_repeats,
        warmup=2,
        params={**params, "max_new_tokens": args.loop_new_tokens},
    )


def bench_fixed(args, path: str, work: Path, bench: Bench) -> None:
    from megatron_sdpo.rollout import SamplingConfig, make_engine

    lengths = [int(x) for x in args.new_tokens.split(",")]
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab, args.seed)
    max_len = max(len(p) for p in prompts) + max(lengths) + 1
    params = {"workload": "fixed", "prompts": args.prompts, "n": args.n}

    def make(kind: str):
        extra = (
            {"run_dir": str(work / "vllm_run_fixed"), "max_num_seqs": args.prompts * args.n} if kind == "vllm" else {}
        )
        return make_engine(kind, model_path=path, seed=args.seed, max_model_len=max_len, eos_token_ids=[], **extra)

    def arm(engine, cfg):
        def measure() -> dict:
            comps = []
            seconds, _ = timed(lambda: comps.extend(engine.generate(prompts, cfg)))
            tokens = sum(len(c.token_ids) for c in comps)
            return {"generate_s": seconds, "generated_tokens": tokens, "tokens_per_s": tokens / seconds}

        return measure

    # One engine at a time, unlike the loop: a second engine's idle threads would slow the first.
    for kind in args.engines.split(","):
        engine = start_engines(
            bench, params, [kind], make, lambda e: e.generate(prompts[:2], SamplingConfig(n=2, max_new_tokens=4))
        )[kind]
        for new in lengths:
            cfg = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=new)
            # One untimed round at the exact workload: vLLM's CPU path warms up per batch shape
            # (seconds), which is start-up cost, not throughput.
            bench.run({kind: arm(engine, cfg)}, rounds=args.repeats, warmup=1, params={**params, "max_new_tokens": new})
        engine = None  # freed before the next engine starts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_rollout.csv")
    ap.add_argument("--workload", default="loop,fixed", help="comma list of loop, fixed")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", default="8,32,128", help="fixed workload lengths")
    ap.add_argument("--repeats", type=int, default=2, help="fixed workload: timed rounds (median, min)")
    ap.add_argument("--loop-new-tokens", type=int, default=32)
    ap.add_argument("--loop-repeats", type=int, default=10, help="loop workload: timed rounds (median)")
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--preset",
        default="tiny",
        help="loop workload: the preset whose model and first-stage prompts to use "
        "(e.g. smollm2_135m; the fixed workload always uses the tiny base)",
    )
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
    bench = Bench("rollout", units=UNITS, out=args.out, baseline="hf")
    if "loop" in workloads:
        bench_loop(args, path, work, bench)
    if "fixed" in workloads:
        bench_fixed(args, path, work, bench)
    summary = bench.write()
    print_summary(summary, metrics=("generate_s", "refit_s", "tokens_per_s", "startup_s", "first_generate_s"))
    # loop: the time of the trainer's step's rollout; fixed: the engines' throughput at one length.
    compared = {"loop": ("generate_s", "generate time"), "fixed": ("tokens_per_s", "throughput")}
    for s in summary:
        p = parse_params(s["params"])
        metric, what = compared[p["workload"]]
        if s["arm"] == "vllm" and s["baseline"] and s["metric"] == metric:
            print(
                f"{p['workload']} max_new_tokens={p['max_new_tokens']}: vLLM / HF {what} = {s['ratio']:.2f}x "
                f"(median of per-round ratios)"
            )
    print(f"wrote {args.out} and {summary_path(args.out)}")


if __name__ == "__main__":
    main()
