"""Shared machinery of the synthetic suite: seeded sampling of unique items and the train/id split.

Every generator samples *item keys* (tuples describing one problem) from its own
`random.Random`, seeded by (domain, split, seed, difficulty): no global RNG is touched. The
"train" and "id" splits draw from the same generator; a stable hash of the key assigns each
possible item to exactly one of them, so the two are disjoint for every seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

from megatron_sdpo.data.records import unit_hash
from megatron_sdpo.errors import DataError

SPLITS: tuple[str, ...] = ("train", "id", "ood_near", "ood_mid", "ood_far")

# Fraction of the train generator's item space held out for the "id" split.
ID_FRACTION = 0.2

NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()


def rng_for(domain: str, split: str, seed: int, difficulty: float) -> random.Random:
    """A private RNG; str seeds are hashed with sha512 by `random`, so this is stable across runs."""
    return random.Random(f"{domain}|{split}|{seed}|{difficulty!r}")


def key_hash(key: Hashable) -> float:
    """A stable hash of an item key in [0, 1)."""
    return unit_hash(repr(key))


def in_id_split(key: Hashable) -> bool:
    return key_hash(key) < ID_FRACTION


def check_args(split: str, n: int, difficulty: float) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown synthetic split {split!r}; expected one of {', '.join(SPLITS)}")
    if not isinstance(n, int) or n < 0:
        raise DataError(f"n must be a non-negative integer, got {n!r}")
    if not 0.0 <= difficulty <= 1.0:
        raise DataError(f"difficulty must be in [0, 1], got {difficulty!r}")


# Paths an exhaustive enumeration may walk before it gives up (science's id split walks ~28k).
MAX_EXHAUSTIVE_PATHS = 200_000


class _Walk:
    """A stand-in for `random.Random` that takes every path through a draw, one per call: the
    outcomes of a call's choices are the digits of an odometer over the choices met so far.

    `random()` gives 0.0 or the largest float below 1: the generators only compare it with their
    difficulty (`rng.random() < difficulty`), so both branches of that test are walked (one only
    at difficulty 0 or 1)."""

    def __init__(self) -> None:
        self.path: list[int] = []
        self.sizes: list[int] = []
        self.i = 0

    def _pick(self, n: int) -> int:
        if n <= 0:
            raise ValueError("empty choice")
        if self.i == len(self.path):
            self.path.append(0)
            self.sizes.append(n)
        v = self.path[self.i]
        self.i += 1
        return v

    def advance(self) -> bool:
        """Move to the next path; False when every path was taken."""
        del self.path[self.i :], self.sizes[self.i :]
        while self.path:
            self.path[-1] += 1
            if self.path[-1] < self.sizes[-1]:
                break
            self.path.pop()
            self.sizes.pop()
        self.i = 0
        return bool(self.path)

    def randrange(self, a: int, b: int | None = None) -> int:
        lo, hi = (0, a) if b is None else (a, b)
        return lo + self._pick(hi - lo)

    def randint(self, a: int, b: int) -> int:
        return a + self._pick(b - a + 1)

    def choice(self, seq):
        return seq[self._pick(len(seq))]

    def random(self) -> float:
        return (0.0, 1.0 - 2.0**-53)[self._pick(2)]

    def sample(self, population, k: int) -> list:
        pool = list(population)
        return [pool.pop(self._pick(len(pool))) for _ in range(k)]

    def shuffle(self, x: list) -> None:
        pool = list(x)
        x[:] = [pool.pop(self._pick(len(pool))) for _ in range(len(pool))]


def all_keys(draw: Callable[[random.Random], Hashable], split: str, *, what: str) -> list:
    """Every key `draw` can give (train/id: of that partition), in a fixed order (by `key_hash`,
    so a prefix is a spread-out sample). Raises DataError when the space is too large to walk."""
    walk = _Walk()
    seen: set = set()
    paths = 0
    while True:
        key = draw(walk)  # type: ignore[arg-type]
        paths += 1
        if paths > MAX_EXHAUSTIVE_PATHS:
            raise DataError(
                f"synthetic {what} split {split!r} is too large to evaluate exhaustively "
                f"(over {MAX_EXHAUSTIVE_PATHS} draws); give n > 0"
            )
        if split not in ("train", "id") or in_id_split(key) == (split == "id"):
            seen.add(key)
        if not walk.advance():
            return sorted(seen, key=key_hash)


def sample_unique(
    rng: random.Random,
    n: int,
    draw: Callable[[random.Random], Hashable],
    split: str,
    *,
    what: str,
) -> list:
    """`n` distinct keys from `draw`; for train/id only keys of that partition are kept.
    `n` = 0: every key of the split (`all_keys`; exhaustive evaluation, no item sampling).

    Raises DataError when the item space is too small to give `n` distinct items.
    """
    if n == 0:
        return all_keys(draw, split, what=what)
    seen: set = set()
    out: list = []
    misses = 0
    limit = 200 * n + 1000
    while len(out) < n:
        key = draw(rng)
        keep = key not in seen
        if keep and split in ("train", "id"):
            keep = in_id_split(key) == (split == "id")
        if keep:
            seen.add(key)
            out.append(key)
        else:
            misses += 1
            if misses > limit:
                raise DataError(
                    f"synthetic {what} split {split!r} cannot give {n} distinct items "
                    f"(got {len(out)}); ask for fewer or raise the difficulty"
                )
    return out


def make_record(domain: str, split: str, seed: int, index: int, prompt: str, solution: str, **fields) -> dict:
    rec = {
        "id": f"syn-{domain}-{split}-{seed}-{index}",
        "domain": domain,
        "split": split,
        "prompt": prompt,
        "source": f"synthetic_{domain}",
        "solution": solution,
    }
    rec.update(fields)
    return rec
