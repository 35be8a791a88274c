"""Synthetic multiple-choice "lab measurement" questions answered as ``<answer>X</answer>``.

"Is the hottest reading below, at or above 5 K? 2 K, 3 K, 6 K. (A) below (B) at (C) above."
The rule is read off the question (take the extreme reading, compare it with the threshold),
not a memorized fact table, so a tiny model can learn it from a little evidence and RL can
sharpen it. The reference response writes both numbers, then the relation and its letter
("6 K vs 5 K: above <answer>C</answer>"), as "3+4=7" does in math.

Why this shape (each measured on the ~1M-parameter tiny base, docs/findings.md):
- The three choices and their letters are the same for every item, so the letter follows from
  the comparison alone: a question whose letter labels one of the listed readings ("6 K (B)")
  needs the model to bind a label to a value, which the base does not learn in warm-up (the
  extreme value right 97%, its letter at chance).
- The readings are listed in ascending order, so the extreme is the first or the last one: with
  the readings shuffled, RL on the letter alone lets the written extreme drift (its errors
  doubled in 60 GRPO steps while the comparison improved), and the in-stage gain stayed within
  item noise. The comparison alone, after a copy, is what RL learns (0.46 -> 0.98 in 60 steps).
- The threshold lies within one of the extreme reading (below / at / above, one outcome each),
  so the three outcomes are equally common and the answer cannot be guessed from the question's
  word ("hottest" readings are not mostly above a random threshold).
`difficulty` is the probability of four readings instead of three.
train / id: "hottest / coldest / heaviest / lightest reading", readings 1-8 (thresholds 0-9).
ood_near: other phrasings ("highest temperature"), readings 1-8.
ood_mid:  training phrasings, readings 11-98 (thresholds 10-99).
ood_far:  other phrasings, six readings 11-98 in no order (the extreme must be found).
compact: two-digit readings 11-16 instead of 11-98; the one-digit spaces are small already
    (id: 272 items) and stay as they are.
"""

from __future__ import annotations

import random

from megatron_sdpo.data.records import LETTERS
from megatron_sdpo.data.synthetic.base import check_args, make_record, rng_for, sample_unique

DEFAULT_DIFFICULTY = 0.5
INSTRUCTION = "Reply <answer>X</answer>."
RELATIONS = ("below", "at", "above")  # the choices, in letter order, for every item

# (the extreme reading's name, unit, pick max?)
TRAIN_PROPS = (
    ("hottest reading", "K", True),
    ("coldest reading", "K", False),
    ("heaviest reading", "g", True),
    ("lightest reading", "g", False),
)
NEAR_PROPS = (
    ("highest temperature", "K", True),
    ("lowest temperature", "K", False),
    ("largest mass", "g", True),
    ("smallest mass", "g", False),
)


def _draw(split: str, difficulty: float, compact: bool = False):
    two_digit = split in ("ood_mid", "ood_far")
    props = NEAR_PROPS if split in ("ood_near", "ood_far") else TRAIN_PROPS
    # readings in [lo, hi]; a threshold one beyond keeps the digit count (0-9, 10-99)
    lo, hi = (11, 16 if compact else 98) if two_digit else (1, 8)

    def draw(rng: random.Random):
        p = rng.randrange(len(props))
        k = 6 if split == "ood_far" else (4 if rng.random() < difficulty else 3)
        values = tuple(rng.sample(range(lo, hi + 1), k))
        if split != "ood_far":
            values = tuple(sorted(values))
        # threshold - extreme: +1 "below", 0 "at", -1 "above"; every outcome for every reading
        return (p, values, rng.choice((1, 0, -1)))

    return draw, props


def generate(
    split: str, n: int, seed: int, difficulty: float = DEFAULT_DIFFICULTY, compact: bool = False
) -> list[dict]:
    """`n` science records of `split`; deterministic in (split, n, seed, difficulty, compact)."""
    check_args(split, n, difficulty)
    rng = rng_for("science", split, seed, difficulty)
    draw, props = _draw(split, difficulty, compact)
    keys = sample_unique(rng, n, draw, split, what="science")
    options = " ".join(f"({LETTERS[j]}) {w}" for j, w in enumerate(RELATIONS))
    out = []
    for i, (p, values, offset) in enumerate(keys):
        name, unit, pick_max = props[p]
        extreme = max(values) if pick_max else min(values)
        threshold = extreme + offset
        j = 1 - offset  # +1 -> below (A), 0 -> at (B), -1 -> above (C)
        letter = LETTERS[j]
        readings = ", ".join(f"{v} {unit}" for v in values)
        prompt = f"Is the {name} below, at or above {threshold} {unit}? {readings}. {options}. {INSTRUCTION}"
        solution = f"{extreme} {unit} vs {threshold} {unit}: {RELATIONS[j]} <answer>{letter}</answer>"
        out.append(make_record("science", split, seed, i, prompt, solution, choices=list(RELATIONS), answer=letter))
    return out
