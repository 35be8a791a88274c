"""The vocabulary-wide tensors of a megatron train step at their peak, loss by loss, against the
memory ledger's `logits` category (memory_ledger.logit_counts).

One megatron rank over gloo (CPU) trains a tiny Qwen3 (bf16 params, EMA teacher, reference) one
step per loss, shaped so that no layer's output is as wide as the vocabulary (the shipped tiny
model's gated MLP is 768 wide, its padded vocabulary too); a dispatch mode
(planning/memory_census.TransientPeak) records every
tensor the step creates and the most bytes alive at once of those whose last dimension is the
vocabulary (the real one or the padded one). Each loss runs at prompt lengths 16 and 48 of
64-token rows, with the statistics chunked over 8 and 16 response tokens
(backend.megatron.loss_chunk_tokens) and whole (0). The ledger counts the peak in tensors of
three sizes: 16-bit over every row token, 16-bit over the response tokens, fp32 over one chunk
(or every response token when whole):

    python tools/loss_memory.py --out loss_memory.json

Written: per loss and point the measured peak, the ledger's bytes for the same micro-batch and
their ratio (the ledger is an upper bound: at least 1.0). Sizes are the tiny model's; the counts
carry to any model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MBS, SEQ = 2, 64
# (prompt length, loss_chunk_tokens): response tokens 96, 32 and 96 per micro-batch, chunks
# shorter than both, so that the three peaks separate the three parts of the count.
POINTS = ((16, 8), (48, 8), (16, 16), (16, 0), (48, 0))
LOSSES = (
    "grpo",
    "grpo_kl",
    "sdpo_full",
    "sdpo_full_clip",
    "sdpo_topk",
    "sdpo_topk_clip",
    "sdpo_topk_clip_t07",
    "hybrid_topk_clip_kl",
)


def _loss(name: str):
    from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss

    def sdpo(topk, clip, temperature=1.0):
        # As megatron runs them at scale: top-k ids picked from the shards, the full-vocabulary
        # JSD from the shards ("fused_kl"; the backend's kernel source holds no logits at all).
        return SDPOLoss(
            variant="logits",
            alpha=0.5,
            topk=topk,
            is_clip=2.0 if clip else None,
            mask_key="distill_mask",
            temperature=temperature,
            **({"topk_source": "shards"} if topk else {"fused": True}),
        )

    return {
        "grpo": lambda: GRPOLoss(on_policy=True),
        "grpo_kl": lambda: GRPOLoss(on_policy=True, kl_coef=0.1),
        "sdpo_full": lambda: sdpo(None, False),
        "sdpo_full_clip": lambda: sdpo(None, True),
        "sdpo_topk": lambda: sdpo(20, False),
        "sdpo_topk_clip": lambda: sdpo(20, True),
        "sdpo_topk_clip_t07": lambda: sdpo(20, True, 0.7),
        "hybrid_topk_clip_kl": lambda: HybridLoss(
            sdpo=sdpo(20, True), grpo=GRPOLoss(on_policy=True, kl_coef=0.1), lam=0.5
        ),
    }[name]()


def _batch(prompt: int, vocab: int):
    import torch

    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: [int(x) for x in torch.randint(3, vocab - 1, (n,), generator=g)]
    prompts = [ids(prompt) for _ in range(MBS)]
    b = SequenceBatch(prompts, [ids(SEQ - prompt) for _ in range(MBS)], [list(p) for p in prompts], {})
    mask = b.response_mask()
    b.tensors.update(loss_mask=mask, distill_mask=mask.clone(), advantages=torch.randn(MBS, generator=g))
    return b


def measure(model_dir: str, losses: list[str]) -> dict:
    """{loss: {"prompt,chunk": peak bytes of vocabulary-wide tensors}} and the widths (one rank)."""
    from megatron_sdpo.planning.memory_census import TransientPeak, measured_backend

    be = measured_backend(model_dir, lr=1e-4, micro_batch_size=MBS, fused_kl="shards")
    vocab, padded = be.vocab_width, be.wlayout.padded_vocab(be.spec) // be.layout.tp
    wide = lambda t: "vocab" if t.dim() and t.shape[-1] in (vocab, padded) else "other"
    out: dict = {"vocab": vocab, "padded_vocab": padded, "peaks": {}}
    for name in losses:
        for prompt, chunk in POINTS:
            be.loss_chunk_tokens = chunk
            b = _batch(prompt, vocab)
            lp = be.logprobs(b)
            b.tensors.update(old_logprobs=lp, rollout_logprobs=lp)
            with TransientPeak(classify=wide) as peak:
                be.train_step(b, _loss(name))
            out["peaks"].setdefault(name, {})[f"{prompt},{chunk}"] = peak.peaks.get("vocab", 0)
    return out


def tiny_model(path: str) -> str:
    """The measured model: models/random_qwen3.QWEN3_SHAPED (fc1 480 wide, vocabulary 718, 768 padded)."""
    from megatron_sdpo.models.random_qwen3 import QWEN3_SHAPED, save_tiny_qwen3

    return save_tiny_qwen3(path, **QWEN3_SHAPED)


def _ledger_logits(model_dir: str, name: str, prompt: int, chunk: int) -> int:
    from transformers import AutoConfig

    from megatron_sdpo.planning import memory_ledger as ml
    from megatron_sdpo.planning.memory_census import MEASURED_LEDGER
    from megatron_sdpo.weights.plan import ModelSpec

    distills = name.startswith(("sdpo", "hybrid"))
    counts = ml.logit_counts(
        distills=distills,
        topk=None if "full" in name else 20,
        is_clip="clip" in name,
        riders=int(distills) + int(name.endswith("kl")),
        temperature=0.7 if name.endswith("t07") else 1.0,
        chunked=chunk > 0,
    )
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
    led = ml.build(
        ml.LedgerInputs(
            spec=spec,
            **MEASURED_LEDGER,
            micro_batch_size=MBS,
            seq=SEQ,
            response=SEQ - prompt,
            loss_chunk_tokens=chunk,
            logit_counts=counts,
        )
    )
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
    import tempfile

    from megatron_sdpo.backends.megatron.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(tmp)
        got = spawn(measure, 1, model_dir, losses, timeout_s=args.timeout)[0]
        return _report(got, model_dir, losses, args.out)


def _report(got: dict, model_dir: str, losses: list[str], out: Path | None) -> int:
    rows = []
    keys = [f"{p},{c}" for p, c in POINTS]
    print("| loss | " + " | ".join(f"prompt {p}, chunk {c or 'whole'}: measured B / ledger" for p, c in POINTS) + " |")
    print("|---|" + "---|" * len(POINTS))
    for name in losses:
        peaks = got["peaks"][name]
        ledger = {k: _ledger_logits(model_dir, name, p, c) for k, (p, c) in zip(keys, POINTS, strict=True)}
        rows.append(
            {
                "loss": name,
                "peaks": peaks,
                "ledger": ledger,
                "ledger_over_peak": {k: round(ledger[k] / peaks[k], 3) for k in keys},
            }
        )
        print(f"| {name} | " + " | ".join(f"{peaks[k]:,} / {rows[-1]['ledger_over_peak'][k]}x" for k in keys) + " |")
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "mbs": MBS,
                    "seq": SEQ,
                    "points": POINTS,
                    "vocab": got["vocab"],
                    "padded_vocab": got["padded_vocab"],
                    "losses": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
