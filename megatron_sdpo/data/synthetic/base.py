"""Shared machinery of the synthetic suite: seeded sampling of unique items and the train/id split.

Every generator samples *item keys* (tuples describing one problem) from its own
`random.Random`, seeded by (domain, split, seed, difficulty): no global RNG is touched. The
"train" and "id" splits draw from the same generator; a stable hash of the key assigns each
possible item to exactly one of them, so the two are disjoint for every seed.
"""
from __future__ import annotations

import hashlib
import random
from typing import Callable, Hashable

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
    """A stable hash of an item key in [0, 1) (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def in_id_split(key: Hashable) -> bool:
    return key_hash(key) < ID_FRACTION


def check_args(split: str, n: int, difficulty: float) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown synthetic split {split!r}; expected one of {', '.join(SPLITS)}")
    if not isinstance(n, int) or n < 0:
        raise DataError(f"n must be a non-negative integer, got {n!r}")
    if not 0.0 <= difficulty <= 1.0:
        raise DataError(f"difficulty must be in [0, 1], got {difficulty!r}")


def sample_unique(
    rng: random.Random,
    n: int,
    draw: Callable[[random.Random], Hashable],
    split: str,
    *,
    what: str,
) -> list:
    """`n` distinct keys from `draw`; for train/id only keys of that partition are kept.

    Raises DataError when the item space is too small to give `n` distinct items.
    """
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
