"""Synthetic stdin/stdout programs: "Read n and print <expression in words>".

Translating words to symbols alone saturates a tiny model, so with probability `difficulty`
the expression chains two constants of one sign ("n plus three plus four", "n minus three minus
four") and the reference program folds them (``print(n+7)``, ``print(n-7)``): writing it needs
the one-digit unsigned sum of the math domain. (Recipe 2 mixed the signs, "n plus six minus
eight" -> ``print(n-2)``; a signed sum with negative results is what GRPO did not teach the
tiny base: docs/findings.md, "Making code learnable".) Otherwise the expression has one
operation and one constant ("n times three" -> ``print(n*3)``).
Variables and phrasings vary so the item space is large.
train / id: the phrasings below. ood_near: another phrasing of the same task.
ood_mid:  two inputs on one line ("Read a and b ..."), the second added at the end.
ood_far:  a list of numbers on one line, reduced by sum / max / min.
compact: two variable names instead of six (a third of the space).
Every record carries three stdin/stdout tests computed by evaluating the reference program.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from megatron_sdpo.data.synthetic.base import NUMBER_WORDS, check_args, make_record, rng_for, sample_unique

DEFAULT_DIFFICULTY = 0.6
INSTRUCTION = "Write Python."

OPS = (("plus", "+"), ("minus", "-"), ("times", "*"))
VARS = ("n", "x", "k", "m", "t", "y")
TRAIN_PHRASES = ("Read {v} and print {words}.", "Input {v}, then print {words}.")
NEAR_PHRASE = "Given {v}, output {words}."
REDUCERS = (("sum", "sum"), ("largest", "max"), ("smallest", "min"))


def _draw(split: str, difficulty: float, compact: bool = False):
    variables = VARS[:2] if compact else VARS

    def draw(rng: random.Random):
        if split == "ood_far":
            return ("list", rng.randrange(len(REDUCERS)))
        steps: tuple[tuple[int, int], ...]
        if rng.random() < difficulty:  # two folded constants of one sign: both + or both -
            op = rng.randrange(2)
            steps = ((op, rng.randint(1, 9)), (op, rng.randint(1, 9)))
        else:
            steps = ((rng.randrange(len(OPS)), rng.randint(2, 20)),)
        var = "a" if split == "ood_mid" else rng.choice(variables)
        phrase = 0 if split in ("ood_near", "ood_mid") else rng.randrange(len(TRAIN_PHRASES))
        return ("ab" if split == "ood_mid" else "n", steps, var, phrase)

    return draw


def _case_inputs(rng: random.Random, kind: str) -> list[str]:
    if kind == "list":
        return [" ".join(str(rng.randint(-9, 20)) for _ in range(rng.randint(2, 5))) for _ in range(3)]
    if kind == "ab":
        return [f"{rng.randint(1, 20)} {rng.randint(1, 20)}" for _ in range(3)]
    return [str(rng.randint(0, 30)) for _ in range(3)]


def _expression(var: str, steps: tuple) -> tuple[str, str]:
    """(words, folded python expression) of `var` followed by `steps` of (op index, constant): the
    steps share one operation (`_draw`), so their constants fold into one by addition."""
    words = var + "".join(f" {OPS[op][0]} {NUMBER_WORDS[k]}" for op, k in steps)
    return words, f"{var}{OPS[steps[0][0]][1]}{sum(k for _, k in steps)}"


def _render(key: tuple, split: str) -> tuple[str, str, Callable[[str], str]]:
    """(prompt text, solution source, python function of the stdin string)."""
    kind = key[0]
    if kind == "list":
        word, fn = REDUCERS[key[1]]
        text = f"Read numbers on one line and print their {word}."
        src = f"xs=list(map(int,input().split()))\nprint({fn}(xs))"
        reducers: dict[str, Callable[[Iterable[int]], int]] = {"sum": sum, "max": max, "min": min}
        reduce = reducers[fn]
        return text, src, lambda s: str(reduce(map(int, s.split())))
    _, steps, var, phrase = key
    words, expr = _expression(var, steps)
    if kind == "ab":
        text = f"Read a and b and print {words} plus b."
        src = f"a,b=map(int,input().split())\nprint({expr}+b)"
        return text, src, lambda s: str(eval(expr + "+b", {}, dict(zip("ab", map(int, s.split()), strict=True))))
    template = NEAR_PHRASE if split == "ood_near" else TRAIN_PHRASES[phrase]
    text = template.format(v=var, words=words)
    src = f"{var}=int(input())\nprint({expr})"
    return text, src, lambda s: str(eval(expr, {}, {var: int(s)}))


def generate(
    split: str, n: int, seed: int, difficulty: float = DEFAULT_DIFFICULTY, compact: bool = False
) -> list[dict]:
    """`n` code records of `split`; deterministic in (split, n, seed, difficulty, compact)."""
    check_args(split, n, difficulty)
    rng = rng_for("code", split, seed, difficulty)
    # ood_far has only a few distinct programs: records differ by their test inputs instead.
    if split == "ood_far" and n:
        keys = [_draw(split, difficulty, compact)(rng) for _ in range(n)]
    else:
        keys = sample_unique(rng, n, _draw(split, difficulty, compact), split, what="code")
    out = []
    for i, key in enumerate(keys):
        text, src, fn = _render(key, split)
        tests = [{"input": s, "output": fn(s)} for s in _case_inputs(rng, key[0])]
        solution = f"```python\n{src}\n```"
        out.append(make_record("code", split, seed, i, f"{text} {INSTRUCTION}", solution, tests=tests))
    return out
