"""Synthetic multiple-choice "lab measurement" questions answered as ``<answer>X</answer>``.

The rule is a monotone property read off the question (pick the largest or the smallest
reading), not a memorized fact table, so a tiny model can learn it from a little evidence and
RL can sharpen it. Each reading is listed before its letter ("5 K (B)") and the reference
response restates the extreme reading, then its letter: finding the letter is then a forward
copy (an induction pattern), where the letter-first listing "B) 5 K" needs a backward lookup
that a ~1M-parameter base does not learn in warm-up (measured: value right 100%, letter at
chance).
`difficulty` is the probability of four choices instead of three (chance 1/4 vs 1/3).
train / id: "Which sample is hottest / coldest / heaviest / lightest?", one-digit readings.
ood_near: other phrasings ("has the highest temperature"), one-digit readings.
ood_mid:  training phrasings, two-digit readings.
ood_far:  other phrasings, two-digit readings and six choices.
compact: one-digit readings 1-6 instead of 1-9 (train / id / ood_near: a seventh of the space);
    two-digit readings 10-17 instead of 10-99.
"""
from __future__ import annotations

import random

from megatron_sdpo.data.records import LETTERS
from megatron_sdpo.data.synthetic.base import check_args, make_record, rng_for, sample_unique

DEFAULT_DIFFICULTY = 0.5
INSTRUCTION = "Reply <answer>X</answer>."

# (superlative, unit, pick max?)
TRAIN_PROPS = (
    ("is hottest", "K", True),
    ("is coldest", "K", False),
    ("is heaviest", "g", True),
    ("is lightest", "g", False),
)
NEAR_PROPS = (
    ("has the highest temperature", "K", True),
    ("has the lowest temperature", "K", False),
    ("has the largest mass", "g", True),
    ("has the smallest mass", "g", False),
)


def _draw(split: str, difficulty: float, compact: bool = False):
    two_digit = split in ("ood_mid", "ood_far")
    props = NEAR_PROPS if split in ("ood_near", "ood_far") else TRAIN_PROPS
    lo, hi = (10, 17 if compact else 99) if two_digit else (1, 6 if compact else 9)

    def draw(rng: random.Random):
        p = rng.randrange(len(props))
        k = 6 if split == "ood_far" else (4 if rng.random() < difficulty else 3)
        return (p, tuple(rng.sample(range(lo, hi + 1), k)))

    return draw, props


def generate(split: str, n: int, seed: int, difficulty: float = DEFAULT_DIFFICULTY, compact: bool = False) -> list[dict]:
    """`n` science records of `split`; deterministic in (split, n, seed, difficulty, compact)."""
    check_args(split, n, difficulty)
    rng = rng_for("science", split, seed, difficulty)
    draw, props = _draw(split, difficulty, compact)
    keys = sample_unique(rng, n, draw, split, what="science")
    out = []
    for i, (p, values) in enumerate(keys):
        word, unit, pick_max = props[p]
        best = max(values) if pick_max else min(values)
        letter = LETTERS[values.index(best)]
        choices = [f"{v} {unit}" for v in values]
        listing = ", ".join(f"{c} ({LETTERS[j]})" for j, c in enumerate(choices))
        prompt = f"Which sample {word}? {listing}. {INSTRUCTION}"
        solution = f"{best} {unit} ({letter}) <answer>{letter}</answer>"
        out.append(make_record("science", split, seed, i, prompt, solution, choices=choices, answer=letter))
    return out
