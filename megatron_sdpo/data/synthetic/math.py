"""Synthetic arithmetic word problems answered as ``\\boxed{N}``.

train / id: addition and subtraction in two phrasings per operator, operands up to
    `max_operand` (difficulty 0 -> 9, 1 -> 99). The default (0) is single-digit operands: a
    ~1M-parameter base learns part of the 126 facts in warm-up, leaving room for RL.
ood_near: the same arithmetic in phrasings never used for training.
ood_mid:  training phrasings, operands beyond the training range (one more digit).
ood_far:  multiplication ("bags of k"), an operator never seen in training.
long_answers: the reference solution works the problem out in words and counts on, back or by
    bags one number at a time (~40-110 tokens of the tiny tokenizer instead of ~10): the warm-up
    text of a base that answers at length, so repetition has room to appear (the prompts are
    unchanged, and the reward reads the last box either way).
compact: two names and two objects instead of eight and six (a twelfth of every split's space),
    so `n: 0` evaluates a split exhaustively in seconds.
"""

from __future__ import annotations

import random

from megatron_sdpo.data.synthetic.base import check_args, make_record, rng_for, sample_unique

DEFAULT_DIFFICULTY = 0.0
INSTRUCTION = "Answer in \\boxed{}."

NAMES = ("Ann", "Bob", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana")
OBJECTS = ("apples", "coins", "books", "shells", "cards", "pens")

TRAIN_TEMPLATES = {
    "+": (
        "{name} has {a} {obj} and gets {b} more. How many {obj} now?",
        "{name} had {a} {obj}. Then {name} found {b}. How many {obj}?",
    ),
    "-": (
        "{name} has {a} {obj} and gives away {b}. How many {obj} are left?",
        "{name} had {a} {obj} and lost {b}. How many {obj} remain?",
    ),
}
NEAR_TEMPLATES = {
    "+": ("What is the total when {name} adds {b} {obj} to {a} {obj}?",),
    "-": ("If {b} of {name}'s {a} {obj} are taken, how many stay?",),
}
FAR_TEMPLATE = "{name} has {a} bags with {b} {obj} each. How many {obj} in all?"


def max_operand(difficulty: float) -> int:
    return 9 + round(90 * difficulty)


def _draw(split: str, hi: int, compact: bool = False):
    names, objects = (NAMES[:2], OBJECTS[:2]) if compact else (NAMES, OBJECTS)

    def draw(rng: random.Random):
        name, obj = rng.choice(names), rng.choice(objects)
        if split == "ood_far":
            return ("*", 0, name, obj, rng.randint(2, 9), rng.randint(2, 9))
        op = rng.choice("+-")
        lo_a, hi_a = (hi + 1, 2 * hi + 1) if split == "ood_mid" else (1, hi)
        a = rng.randint(lo_a, hi_a)
        b = rng.randint(1, a) if op == "-" else rng.randint(1, hi_a)
        templates = NEAR_TEMPLATES if split == "ood_near" else TRAIN_TEMPLATES
        return (op, rng.randrange(len(templates[op])), name, obj, a, b)

    return draw


def worked_solution(op: str, name: str, obj: str, a: int, b: int, c: int) -> str:
    """The long-answer reference: the question restated, every number counted, the box last."""
    if op == "*":
        steps = [b * k for k in range(1, a + 1)]
        start, how = f"{name} has {a} bags with {b} {obj} in each.", f"Add {b} for each bag"
    else:
        steps = list(range(a + 1, c + 1)) if op == "+" else list(range(a - 1, c - 1, -1))
        verb = "gets" if op == "+" else "gives away"
        start = f"{name} starts with {a} {obj} and {verb} {b}."
        how = f"Count {'on' if op == '+' else 'back'} {b} from {a}"
    counted = ", ".join(map(str, steps)) if steps else str(a)
    return f"{start} {how}: {counted}. So {name} has {c} {obj}. The answer is {c}. \\boxed{{{c}}}"


def generate(
    split: str,
    n: int,
    seed: int,
    difficulty: float = DEFAULT_DIFFICULTY,
    compact: bool = False,
    long_answers: bool = False,
) -> list[dict]:
    """`n` math records of `split`; deterministic in (split, n, seed, difficulty, compact);
    `long_answers` changes only the reference solutions (`worked_solution`)."""
    check_args(split, n, difficulty)
    rng = rng_for("math", split, seed, difficulty)
    keys = sample_unique(rng, n, _draw(split, max_operand(difficulty), compact), split, what="math")
    out = []
    for i, (op, t, name, obj, a, b) in enumerate(keys):
        if op == "*":
            text, c = FAR_TEMPLATE, a * b
        else:
            templates = NEAR_TEMPLATES if split == "ood_near" else TRAIN_TEMPLATES
            text, c = templates[op][t], (a + b if op == "+" else a - b)
        prompt = text.format(name=name, obj=obj, a=a, b=b) + " " + INSTRUCTION
        solution = worked_solution(op, name, obj, a, b, c) if long_answers else f"{a}{op}{b}={c} \\boxed{{{c}}}"
        out.append(make_record("math", split, seed, i, prompt, solution, answer=str(c)))
    return out
