"""Build the tiny base model (tokenizer + ~1M-param Qwen3 + supervised warm-up) on CPU.

    python tools/make_tiny_base.py --out megatron_sdpo/assets/tiny_base [--steps N] [--eval 64]
        [--trace-every 50] [--boxed-duplicate-rate 0.1] [--long-math]

Deterministic from --seed. --eval N reports greedy and sampled (temperature 1) accuracy per
domain and split on N synthetic records each (needs megatron_sdpo.rewards). --trace-every K
prints, every K warm-up steps, the sampled train accuracy and greedy id accuracy per domain
(32 records each): RL needs the base at 20-50%, and this shows where the warm-up crosses it.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_sdpo.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from megatron_sdpo.models import tiny

    defaults = tiny.TinyConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (replaced atomically)")
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--steps", type=int, default=defaults.steps)
    ap.add_argument("--batch-size", type=int, default=defaults.batch_size)
    ap.add_argument("--lr", type=float, default=defaults.lr)
    ap.add_argument("--n-train", type=int, default=defaults.n_train_per_domain, help="warm-up records per domain")
    ap.add_argument("--teacher-fraction", type=float, default=defaults.teacher_fraction)
    ap.add_argument(
        "--difficulty",
        action="append",
        default=[],
        metavar="DOMAIN=X",
        help="override a synthetic generator's difficulty (repeatable)",
    )
    ap.add_argument(
        "--boxed-duplicate-rate",
        type=float,
        default=defaults.boxed_duplicate_rate,
        help="share of math warm-up solutions ending with a second identical \\boxed{} (artifact assay)",
    )
    ap.add_argument(
        "--long-math",
        action="store_true",
        help="math warm-up solutions worked out in words (the tiny-long base of the long-answer probe)",
    )
    ap.add_argument("--threads", type=int, default=defaults.threads)
    ap.add_argument("--eval", type=int, default=0, metavar="N", help="evaluate on N records per domain/split")
    ap.add_argument("--trace-every", type=int, default=0, metavar="K", help="trace calibration every K steps")
    args = ap.parse_args(argv)
    try:
        difficulty = {}
        for item in args.difficulty:
            dom, _, val = item.partition("=")
            try:
                difficulty[dom] = float(val)
            except ValueError:
                raise UserError(f"--difficulty expects DOMAIN=FLOAT, got {item!r}") from None
        knobs = (
            "seed",
            "steps",
            "batch_size",
            "lr",
            "teacher_fraction",
            "threads",
            "boxed_duplicate_rate",
            "long_math",
        )
        same = {k: getattr(args, k) for k in knobs}
        cfg = tiny.TinyConfig(**same, n_train_per_domain=args.n_train, difficulty=difficulty)
        if args.trace_every < 0:
            raise UserError(f"--trace-every must be >= 0, got {args.trace_every}")
        # Worked math answers run to ~110 tokens: a 48-token budget would cut them off.
        budget = 160 if args.long_math else 48
        hook = _tracer(args.trace_every, args.seed, budget) if args.trace_every else None
        info = tiny.build_tiny_base(args.out, cfg, log=lambda s: print(s, flush=True), on_step=hook)
        print(json.dumps({k: v for k, v in info.items() if k != "config"}))
        if args.eval:
            report = tiny.evaluate_base(
                args.out,
                n=args.eval,
                seed=args.seed + 100,
                difficulty=difficulty,
                threads=args.threads,
                max_new_tokens=budget,
            )
            print(tiny.format_report(report))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _tracer(every: int, seed: int, max_new_tokens: int = 48):
    """on_step hook printing sampled-train / greedy-id accuracy per domain every `every` steps.
    Sampling uses its own generator, so the build stays bit-identical to an untraced one."""
    from megatron_sdpo.data.synthetic import generate
    from megatron_sdpo.interfaces.domains import DOMAINS
    from megatron_sdpo.models import tiny

    sets = {d: (generate(d, "train", 32, seed), generate(d, "id", 32, seed + 100)) for d in DOMAINS}

    def hook(step: int, model, tokenizer) -> None:
        if step % every:
            return
        model.eval()
        cells = []
        for d, (train, held) in sets.items():
            t1 = tiny.accuracy(model, tokenizer, train, greedy=False, seed=step, max_new_tokens=max_new_tokens)
            greedy = tiny.accuracy(model, tokenizer, held, greedy=True, max_new_tokens=max_new_tokens)
            cells.append(f"{d} {t1:.2f}/{greedy:.2f}")
        model.train()
        print(f"step {step:4d} train-t1/id-greedy: " + "  ".join(cells), flush=True)

    return hook


if __name__ == "__main__":
    sys.exit(main())
