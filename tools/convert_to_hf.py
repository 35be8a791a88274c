"""Convert a megatron_sdpo megatron-backend checkpoint (dist_checkpointing) to an HF directory.

    python tools/convert_to_hf.py CHECKPOINT --hf-model BASE_HF_DIR --out OUT_DIR [--model teacher]

BASE_HF_DIR is the HF model the run started from (config and tokenizer are copied from it).
Runs on CPU or one GPU as a single process, whatever TP/PP/DP layout wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--hf-model", required=True, help="HF directory of the base model (config, tokenizer)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--model", default="policy", choices=["policy", "teacher"])
    p.add_argument("--vocab-divisor", type=int, default=128, help="the run's backend.megatron.vocab_divisor")
    args = p.parse_args(argv)

    from megatron_sdpo.errors import UserError

    try:
        from megatron_sdpo.backends.megatron.checkpoint import convert_to_hf
        from megatron_sdpo.models.hf_dir import check_hf_model_dir

        check_hf_model_dir(args.hf_model, weights=False, what="--hf-model")

        names = convert_to_hf(
            args.checkpoint, args.hf_model, args.out, model=args.model, vocab_divisor=args.vocab_divisor
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
