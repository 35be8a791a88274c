"""Train-step time of a backend, padded layout vs packed rows, side by side in one run.

The workload is the tiny run's: 128 sequences (16 prompts x 8 samples: `--group-size` samples
share a prompt, as in a GRPO/SDPO batch; 1 makes every prompt distinct), prompts of 20-40
tokens, responses of 3-32 tokens (uniform), micro-batches of 64; for SDPO the teacher prompt
is the student prompt plus a 30-60 token re-prompt (a solution shown to the teacher), one per
sample. Each arm (padded; for each --row-tokens value, 0 meaning one row per micro-batch,
packed rows with every sample's prompt (`packed_K`) and with a group's prompt once
(`shared_K`, backend.share_prompts)) owns a backend built from the same weights. Every round
runs every arm once in a rotated order (so a busy machine slows all arms alike), after one
warm-up round (bench_harness.Bench.run). Metrics per (loss, arm, round), in the bench_harness
CSV schema (params: loss, samples, group_size, micro_batch_size, threads, backend): step_s,
step_cpu_s (the process's CPU seconds, all threads: on a machine shared with other jobs they
measure the work done, which the wall time blurs with waiting), model_tokens (the tokens each
layout feeds the model per step; padded: B x longest, packed: rows x width), real_tokens; the
.summary.csv next to `--out` has the medians over rounds and their ratios to the padded arm.

`--backend megatron`: the megatron backend (world of one), arms `padded` and `packed` (THD rows,
one per micro-batch; backends/megatron/packed.py), one backend whose layout is switched between
steps (megatron's parallel state is per process).

    python tools/bench_pack.py --rounds 7 --out bench_pack.csv
    python tools/bench_pack.py --backend megatron --rounds 5 --out bench_pack_megatron.csv
    python tools/bench_pack.py --model path/to/hf_dir --losses sdpo --row-tokens 0,512
"""

from __future__ import annotations

import argparse
import sys

from bench_harness import Bench, print_summary, timed

UNITS = {"step_s": "s", "step_cpu_s": "s", "model_tokens": "tokens", "real_tokens": "tokens"}


def make_batch(n: int, vocab: int, seed: int, sdpo: bool, group: int = 1):
    import torch

    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(20, 41, (-(-n // group),), generator=g).tolist()
    r_len = torch.randint(3, 33, (n,), generator=g).tolist()
    ids = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()
    distinct = [ids(k) for k in p_len]
    prompts = [distinct[i // group] for i in range(n)]
    responses = [ids(k) for k in r_len]
    T = max(r_len)
    mask = torch.zeros(n, T)
    for i, k in enumerate(r_len):
        mask[i, :k] = 1.0
    teacher = [p + ids(int(torch.randint(30, 61, (1,), generator=g))) for p in prompts] if sdpo else None
    tensors = {
        "loss_mask": mask,
        "advantages": torch.randn(n, generator=g),
        "rollout_logprobs": -torch.rand(n, T, generator=g),
    }
    return SequenceBatch(prompts, responses, teacher, tensors)


def model_tokens(batch, mbs: int, packing: bool, row_tokens: int, share: bool = False) -> tuple[int, int]:
    """(tokens the student's forwards see per step, real tokens: every sample's prompt and
    response) for this layout."""
    from megatron_sdpo.backends.varlen import pack_varlen

    total = real = 0
    for s in range(0, len(batch), mbs):
        p, r = batch.prompt_ids[s : s + mbs], batch.response_ids[s : s + mbs]
        real += sum(len(a) + len(b) for a, b in zip(p, r, strict=True))
        if packing:
            vb = pack_varlen(
                p, r, response_len=batch.max_response_len, pad_id=0, row_tokens=row_tokens, share_prompts=share
            )
            total += vb.input_ids.numel()
        else:
            total += len(p) * (max(map(len, p)) + batch.max_response_len)
    return total, real


def megatron_tokens(batch, mbs: int, packing: bool) -> tuple[int, int]:
    """(model_tokens, real_tokens) of the student's rows in the megatron backend (no pipeline
    parallelism): padded rows are the step's longest sample long, teacher prompts included (the
    riders share the row length); a packed row is as long as its micro-batch's samples."""
    from megatron_sdpo.backends.megatron.batching import packed_len

    n, r = len(batch), batch.response_ids
    real = packed_len(batch.prompt_ids, r)
    if packing:
        return sum(packed_len(batch.prompt_ids[s : s + mbs], r[s : s + mbs]) for s in range(0, n, mbs)), real
    prompts = [batch.prompt_ids] + ([batch.teacher_prompts()] if batch.teacher_prompt_ids else [])
    return n * max(len(p[i]) + len(r[i]) for p in prompts for i in range(n)), real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (default: the shipped tiny base)")
    ap.add_argument("--backend", default="hf", choices=("hf", "megatron"))
    ap.add_argument("--losses", default="grpo,sdpo")
    ap.add_argument("--row-tokens", default="0,256,512", help="packed arms' row capacities (0: one row)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (1: all prompts distinct)")
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_pack.csv")
    args = ap.parse_args(argv)

    import torch

    from megatron_sdpo.algorithms.losses import GRPOLoss, SDPOLoss
    from megatron_sdpo.backends.hf import HFBackend

    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from megatron_sdpo.models.tiny import ensure_tiny_base

        model = ensure_tiny_base()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    losses = {"grpo": lambda: GRPOLoss(on_policy=True), "sdpo": lambda: SDPOLoss(alpha=0.5, topk=None, is_clip=2.0)}
    if args.group_size < 1:
        ap.error("--group-size must be >= 1")
    ks = list(map(int, args.row_tokens.split(",")))
    arms = [("padded", False, 0, False)] + [
        (f"{name}_{k}", True, k, share) for k in ks for name, share in (("packed", False), ("shared", True))
    ]
    if args.backend == "megatron":
        arms = [("padded", False, 0, False), ("packed", True, 0, False)]
    bench = Bench("pack", units=UNITS, out=args.out, baseline="padded")
    for name in args.losses.split(","):
        if name not in losses:
            ap.error(f"--losses: unknown {name!r} (grpo, sdpo)")
        batch = make_batch(args.samples, vocab, args.seed, sdpo=name == "sdpo", group=args.group_size)
        if args.backend == "megatron":
            backends = megatron_arms(model, args, with_teacher=name == "sdpo")
        else:
            backends = {
                arm: HFBackend(
                    model,
                    lr=1e-5,
                    micro_batch_size=args.micro_batch_size,
                    seed=args.seed,
                    with_teacher=name == "sdpo",
                    packing=packing,
                    pack_row_tokens=k,
                    share_prompts=share,
                )
                for arm, packing, k, share in arms
            }

        def step(arm: str, packing: bool, k: int, share: bool, name=name, batch=batch, backends=backends):
            if args.backend == "megatron":
                fed, real = megatron_tokens(batch, args.micro_batch_size, packing)
            else:
                fed, real = model_tokens(batch, args.micro_batch_size, packing, k, share)

            def measure() -> dict:
                wall, cpu = timed(lambda: backends[arm].train_step(batch, losses[name]()))
                return {"step_s": wall, "step_cpu_s": cpu, "model_tokens": fed, "real_tokens": real}

            return measure

        params = {
            "loss": name,
            "samples": args.samples,
            "group_size": args.group_size,
            "micro_batch_size": args.micro_batch_size,
            "threads": args.threads,
            "backend": args.backend,
        }
        bench.run(
            {arm: step(arm, packing, k, share) for arm, packing, k, share in arms},
            rounds=args.rounds,
            params=params,
            warmup=1,
        )
    if args.backend == "megatron":
        from megatron_sdpo.backends.megatron.parallel import destroy

        destroy()
    print_summary(bench.write(), metrics=("step_s", "step_cpu_s", "model_tokens"))
    return 0


class _Layout:
    """One megatron backend seen through a layout: each train step runs with `packing` set."""

    def __init__(self, backend, packing: bool):
        self.backend, self.packing = backend, packing

    def train_step(self, batch, loss_fn):
        self.backend.packing = self.packing
        return self.backend.train_step(batch, loss_fn)


def megatron_arms(model: str, args, *, with_teacher: bool) -> dict:
    """The megatron arms over one backend (a second one in the process would share its parallel
    state); the weights both arms train are the same, the layouts differ."""
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.parallel import destroy

    destroy()  # the previous loss's backend, if any
    be = MegatronBackend(
        model, lr=1e-5, micro_batch_size=args.micro_batch_size, seed=args.seed, with_teacher=with_teacher
    )
    if not be.packing:
        raise SystemExit(f"{model}: this model's layers take the padded layout only; nothing to compare")
    return {"padded": _Layout(be, False), "packed": _Layout(be, True)}


if __name__ == "__main__":
    sys.exit(main())
