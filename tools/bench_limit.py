"""How close the train phase is to the machine's limit: model FLOP utilization of one train step.

    python tools/bench_limit.py --models tiny,smollm2-135m-instruct --algorithms grpo,sdpo \
        --rounds 3 --out bench_limit.csv

Per (model, algorithm) it builds the run's HF backend and loss (`load_config` of the model's
preset, `tiny` or `smollm2_real`, with the algorithm set, so packing, shared prompts,
micro-batch and dtype are a run's; `--micro-batch` overrides the micro-batch),
a batch of `--prompts` x `--samples` synthetic math prompts in the chat template with random
responses of `--new-tokens` / 2 .. `--new-tokens` tokens (SDPO: every sample has a teacher
prompt, the prompt plus a sibling's response; GRPO: advantages of both signs, so no row is
skipped), and times `backend.train_step` (`--rounds` after one warm-up).

- peak: the best matrix-multiply rate of the train dtype at `--threads` threads (square
  `torch.mm` of 512..2048), the machine's limit for this work;
- model FLOPs of a step: 2 x (the decoder's matrix parameters) per token processed plus the
  causal attention's 2 x 2 x layers x width x (context / 2) per token, forward once and backward
  twice for the policy, forward once for the teacher (SDPO); the output projection on response
  tokens only (where the backend computes logits). Tokens processed are the packed rows' (a
  group's prompt once where prompts are shared);
- mfu: model FLOPs / step time / peak;
- what keeps it from more: one profiled step (torch.profiler, with FLOP counts): the share of
  the step's CPU time in matrix multiplies and their own rate against the peak, and the five
  largest other operators by self time.

CSV: bench_harness's schema (rounds) and its .summary.csv (medians); `--json` writes the
profile's breakdown too. CPU numbers are for this machine only; ratios (mfu) travel better.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_harness import Bench, median

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")


def peak_matmul_flops(dtype: torch.dtype, device: torch.device, reps: int = 5) -> float:
    """Best FLOP/s of square `torch.mm` at sizes 512..2048 (the median of `reps` at each)."""
    best = 0.0
    for n in (512, 1024, 2048):
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        torch.mm(a, b)
        times = []
        for _ in range(reps):
            _sync(device)
            t = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            times.append(time.perf_counter() - t)
        best = max(best, 2 * n**3 / median(times))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The preset whose backend settings (micro-batch, dtype) a model's runs use.
PRESETS = {"tiny": "tiny", "smollm2-135m-instruct": "smollm2_real"}


def make_case(
    model: str,
    algorithm: str,
    prompts: int,
    samples: int,
    new_tokens: int,
    micro_batch: int | None = None,
    seed: int = 0,
):
    """(backend, loss, batch, cfg) of one arm."""
    from megatron_sdpo import builders
    from megatron_sdpo.algorithms.grpo import group_advantages
    from megatron_sdpo.algorithms.registry import build_loss
    from megatron_sdpo.chat import record_prompts
    from megatron_sdpo.config import load_config
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.interfaces.backend import SequenceBatch

    overrides = [
        f"model.path={model}",
        f"algorithm.name={algorithm}",
        f"algorithm.prompts_per_step={prompts}",
        f"algorithm.group_size={samples}",
    ]
    if micro_batch is not None:
        overrides.append(f"backend.micro_batch_size={micro_batch}")
    cfg = load_config(PRESETS.get(model, "tiny"), overrides)
    path = builders.resolve_model_path(cfg)
    tok = builders.load_tokenizer(path)
    backend = builders.make_backend(cfg, path, tok)
    loss = build_loss(cfg, topk_source=backend.topk_source)
    g = torch.Generator().manual_seed(seed)
    ids = record_prompts(tok, generate("math", "id", prompts, seed))
    vocab = len(tok)
    rows_p, rows_r = [], []
    for p in ids:
        for _ in range(samples):
            n = int(torch.randint(new_tokens // 2, new_tokens + 1, (1,), generator=g))
            rows_p.append(p)
            rows_r.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    teacher = None
    if algorithm != "grpo":  # every sample re-prompted with a sibling's response
        teacher = [p + rows_r[(i + 1) % len(rows_r)] for i, p in enumerate(rows_p)]
    batch = SequenceBatch(rows_p, rows_r, teacher, {})
    mask = batch.response_mask()
    rewards = (torch.arange(len(rows_p)) % 2).float()  # both signs in every group
    batch.tensors.update(
        loss_mask=mask,
        distill_mask=mask,
        advantages=group_advantages(rewards, group_size=samples, norm_by_std=False),
        rollout_logprobs=torch.full(mask.shape, -5.0) * mask,
    )
    from megatron_sdpo.rollout.guard import attach_guard_tensors

    attach_guard_tensors(batch.tensors, mask)
    return backend, loss, batch, cfg


def model_flops(backend, batch, *, teacher: bool) -> float:
    """Model FLOPs of one train step (module docstring)."""
    cfg = backend.policy.config
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    matrix = sum(
        p.numel()
        for n, p in backend.policy.named_parameters()
        if p.ndim == 2 and "embed" not in n and "lm_head" not in n
    )
    head = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    width = cfg.num_attention_heads * head

    def forward(prompts, responses) -> float:
        shared = backend.share_prompts
        total = 0.0
        seen: set = set()
        for p, r in zip(prompts, responses, strict=True):
            new_prompt = not (shared and tuple(p) in seen)
            seen.add(tuple(p))
            tokens = (len(p) if new_prompt else 0) + len(r)
            ctx_mean = (len(p) + len(r)) / 2  # causal: each token attends its prefix
            total += tokens * (2 * matrix + 4 * L * width * ctx_mean) + len(r) * 2 * V * H
        return total

    flops = 3 * forward(batch.prompt_ids, batch.response_ids)
    if teacher:
        flops += forward(batch.teacher_prompts(), batch.response_ids)
    return flops


def timed_step(backend, loss, batch) -> float:
    _sync(backend.device)
    t = time.perf_counter()
    backend.train_step(batch, loss)
    _sync(backend.device)
    return time.perf_counter() - t


def profile_step(backend, loss, batch, peak: float) -> dict:
    """One profiled step: matrix multiplies' share of CPU self time and their rate vs the peak;
    the five largest other operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        backend.train_step(batch, loss)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = [e for e in events if e.key in MATMUL_OPS]
    mm_time = sum(e.self_cpu_time_total for e in mm)
    mm_flops = sum(e.flops or 0 for e in mm)
    others = sorted((e for e in events if e.key not in MATMUL_OPS), key=lambda e: -e.self_cpu_time_total)[:5]
    return {
        "matmul_time_share": mm_time / max(total, 1),
        "matmul_rate_vs_peak": (mm_flops / (mm_time * 1e-6)) / peak if mm_time else 0.0,
        "top_other_ops": [(e.key, round(e.self_cpu_time_total / max(total, 1), 4)) for e in others],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct")
    ap.add_argument("--algorithms", default="grpo,sdpo")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--micro-batch", type=int, default=None, help="samples per forward/backward (default: the preset's)"
    )
    ap.add_argument("--out", default="-")
    ap.add_argument("--json", default=None, help="also write the profiles' breakdown here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    profiles = {}
    units = {"train_step_s": "s", "model_gflop": "GFLOP", "achieved_gflops": "GFLOP/s", "peak_gflops": "GFLOP/s"}
    bench = Bench("limit", units=units, out=args.out)
    cases = [(m, a) for m in args.models.split(",") for a in args.algorithms.split(",")]
    peaks: dict[torch.dtype, float] = {}
    for model, algorithm in cases:
        backend, loss, batch, cfg = make_case(
            model, algorithm, args.prompts, args.samples, args.new_tokens, args.micro_batch
        )
        dtype = backend.dtype
        if dtype not in peaks:
            peaks[dtype] = peak_matmul_flops(dtype, device)
        peak = peaks[dtype]
        flops = model_flops(backend, batch, teacher=algorithm != "grpo")
        params = {
            "model": model,
            "algorithm": algorithm,
            "dtype": str(dtype).removeprefix("torch."),
            "device": device.type,
            "threads": args.threads,
            "prompts": args.prompts,
            "samples": args.samples,
            "new_tokens": args.new_tokens,
            "micro_batch": backend.micro_batch_size,
        }
        arm = f"{model}_{algorithm}"
        timed_step(backend, loss, batch)  # warm-up
        for r in range(1, args.rounds + 1):
            s = timed_step(backend, loss, batch)
            bench.record(
                arm,
                r,
                {
                    "train_step_s": s,
                    "model_gflop": flops / 1e9,
                    "achieved_gflops": flops / s / 1e9,
                    "peak_gflops": peak / 1e9,
                    "mfu": flops / s / peak,
                },
                params,
            )
        prof = profile_step(backend, loss, batch, peak)
        bench.record(arm, 1, {k: prof[k] for k in ("matmul_time_share", "matmul_rate_vs_peak")}, params)
        profiles[arm] = {**prof, "params": params}
        if args.out != "-":
            bench.write()
        del backend
    bench.write()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(profiles, f, indent=1)
    for arm, p in profiles.items():
        print(
            f"{arm}: matmul {p['matmul_time_share']:.0%} of the step at {p['matmul_rate_vs_peak']:.0%} of peak; "
            f"then {', '.join(f'{k} {v:.0%}' for k, v in p['top_other_ops'])}"
        )


if __name__ == "__main__":
    main()
