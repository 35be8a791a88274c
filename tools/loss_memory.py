"""The vocabulary-wide tensors of a megatron train step at their peak, loss by loss, against the
memory ledger's `logits` category.

One megatron rank over gloo (CPU) trains the shipped tiny model (bf16 params, EMA teacher,
reference) one step per loss; a dispatch mode (planning/memory_census.TransientPeak) records every
tensor the step creates and the most bytes alive at once of those whose last dimension is the
vocabulary (the real one or the padded one). Each loss runs at two prompt lengths, so the peak
splits into a part over every token of the rows (the model's 16-bit logits and their gradients)
and a part over the response tokens (the fp32 shards the losses read), in tensors:

    peak = full_row_16bit x 2 x rows x seq x padded_vocab + response_fp32 x 4 x response_tokens x vocab

    python tools/loss_memory.py --out loss_memory.json

Written: per loss the two measured peaks, the fitted counts and the ledger's `logits` bytes for
the same micro-batch (and their ratio). Sizes are the tiny model's; the counts carry to any model.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MBS, SEQ = 2, 64
PROMPTS = (16, 48)  # response shares 3/4 and 1/4
LOSSES = ("grpo", "grpo_kl", "sdpo_full", "sdpo_full_clip", "sdpo_topk", "sdpo_topk_clip", "sdpo_topk_clip_t07",
          "hybrid_topk_clip_kl")


def _loss(name: str):
    from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss

    def sdpo(topk, clip, temperature=1.0):
        return SDPOLoss(variant="logits", alpha=0.5, topk=topk, is_clip=2.0 if clip else None,
                        mask_key="distill_mask", temperature=temperature)

    return {
        "grpo": lambda: GRPOLoss(on_policy=True),
        "grpo_kl": lambda: GRPOLoss(on_policy=True, kl_coef=0.1),
        "sdpo_full": lambda: sdpo(None, False),
        "sdpo_full_clip": lambda: sdpo(None, True),
        "sdpo_topk": lambda: sdpo(20, False),
        "sdpo_topk_clip": lambda: sdpo(20, True),
        "sdpo_topk_clip_t07": lambda: sdpo(20, True, 0.7),
        "hybrid_topk_clip_kl": lambda: HybridLoss(sdpo=sdpo(20, True), grpo=GRPOLoss(on_policy=True, kl_coef=0.1),
                                                  lam=0.5),
    }[name]()


def _batch(prompt: int, vocab: int):
    import torch

    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: [int(x) for x in torch.randint(3, vocab - 1, (n,), generator=g)]  # noqa: E731
    prompts = [ids(prompt) for _ in range(MBS)]
    b = SequenceBatch(prompts, [ids(SEQ - prompt) for _ in range(MBS)], [list(p) for p in prompts], {})
    mask = b.response_mask()
    b.tensors.update(loss_mask=mask, distill_mask=mask.clone(), advantages=torch.randn(MBS, generator=g))
    return b


def measure(model_dir: str, losses: list[str]) -> dict:
    """{loss: {prompt: peak bytes of vocabulary-wide tensors}} and the widths (one rank)."""
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig
    from megatron_sdpo.planning.memory_census import TransientPeak

    be = MegatronBackend(model_dir, lr=1e-4, micro_batch_size=MBS, parallel=ParallelConfig(tp=1, pp=1),
                         with_teacher=True, with_reference=True, packing=False,
                         options=ModelOptions(precision=PrecisionConfig(params="bfloat16")))
    vocab, padded = be.vocab_width, be.wlayout.padded_vocab(be.spec) // be.layout.tp
    wide = lambda t: "vocab" if t.dim() and t.shape[-1] in (vocab, padded) else "other"  # noqa: E731
    out: dict = {"vocab": vocab, "padded_vocab": padded, "peaks": {}}
    for name in losses:
        for prompt in PROMPTS:
            b = _batch(prompt, vocab)
            lp = be.logprobs(b)
            b.tensors.update(old_logprobs=lp, rollout_logprobs=lp)
            with TransientPeak(classify=wide) as peak:
                be.train_step(b, _loss(name))
            out["peaks"].setdefault(name, {})[prompt] = peak.peaks.get("vocab", 0)
    return out


def _fit(peaks: dict, vocab: int, padded: int) -> tuple[float, float]:
    """(full-row 16-bit tensors, response fp32 tensors) through the two prompt lengths."""
    (p1, a), (p2, b) = sorted(peaks.items())
    r1, r2 = MBS * (SEQ - p1), MBS * (SEQ - p2)
    response = (a - b) / (4 * vocab * (r1 - r2))
    full = (a - response * 4 * vocab * r1) / (2 * MBS * SEQ * padded)
    return full, response


def _ledger_logits(model_dir: str, name: str) -> int:
    from transformers import AutoConfig

    from megatron_sdpo.planning import memory_ledger as ml
    from megatron_sdpo.weights.plan import ModelSpec

    distills = name.startswith(("sdpo", "hybrid"))
    riders = int(distills) + int(name.endswith("kl"))
    copies = ml.logit_copies(distills=distills, topk=None if "full" in name else 20, is_clip="clip" in name,
                             riders=riders)
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
    led = ml.build(ml.LedgerInputs(spec=spec, megatron=True, param_bytes=2, activation_bytes=2, with_teacher=True,
                                   with_reference=True, micro_batch_size=MBS, seq=SEQ, logit_copies=copies))
    return led.categories["logits"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of: {', '.join(LOSSES)}")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the measuring rank")
    args = ap.parse_args(argv)
    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    bad = [x for x in losses if x not in LOSSES]
    if bad:
        print(f"error: unknown loss {bad[0]!r}; known: {', '.join(LOSSES)}", file=sys.stderr)
        return 2
    from megatron_sdpo.backends.megatron.launch import spawn
    from megatron_sdpo.models.tiny import SHIPPED_DIR

    got = spawn(measure, 1, str(SHIPPED_DIR), losses, timeout_s=args.timeout)[0]
    rows = []
    print("| loss | peak, prompt 16 (B) | peak, prompt 48 (B) | full-row 16-bit tensors | response fp32 tensors "
          "| ledger logits (B) | ledger / peak at prompt 16 |")
    print("|---|---|---|---|---|---|---|")
    for name in losses:
        peaks = got["peaks"][name]
        full, response = _fit(peaks, got["vocab"], got["padded_vocab"])
        ledger = _ledger_logits(str(SHIPPED_DIR), name)
        rows.append({"loss": name, "peaks": peaks, "full_row_16bit": round(full, 3), "response_fp32": round(response, 3),
                     "ledger_logits": ledger, "ledger_over_peak": round(ledger / peaks[PROMPTS[0]], 3)})
        r = rows[-1]
        print(f"| {name} | {peaks[PROMPTS[0]]:,} | {peaks[PROMPTS[1]]:,} | {r['full_row_16bit']} | {r['response_fp32']} "
              f"| {ledger:,} | {r['ledger_over_peak']} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"mbs": MBS, "seq": SEQ, "prompts": PROMPTS, "vocab": got["vocab"],
                                        "padded_vocab": got["padded_vocab"], "losses": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
