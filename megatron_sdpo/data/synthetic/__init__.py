"""The built-in synthetic suite: four domains x five splits, small enough for a ~1M-param model.

`generate(domain, split, n, seed)` is deterministic (private seeded RNGs, no global state).
Splits: "train"; "id" (held-out items of the train generator, disjoint from train for every
seed); "ood_near" / "ood_mid" / "ood_far" (out of distribution at increasing distance).
Each record carries "solution", an ideal response used for the supervised warm-up.
"""

from __future__ import annotations

from megatron_sdpo.data.synthetic import code, math, science, tooluse
from megatron_sdpo.data.synthetic.base import SPLITS
from megatron_sdpo.errors import DataError
from megatron_sdpo.interfaces.domains import DOMAINS

_MODULES = {"math": math, "science": science, "tooluse": tooluse, "code": code}

DEFAULT_DIFFICULTY: dict[str, float] = {d: m.DEFAULT_DIFFICULTY for d, m in _MODULES.items()}


def generate(
    domain: str,
    split: str,
    n: int,
    seed: int,
    difficulty: float | None = None,
    *,
    instruction: str | None = None,
    compact: bool = False,
) -> list[dict]:
    """`n` records of `domain` / `split`; `difficulty` in [0, 1] (None: the calibrated default).
    `compact`: the domain's smaller surface (fewer names / values; its module docstring says which),
    a subset of the full space on the same train / id partition, small enough for `n` = 0.

    `instruction` replaces the domain's INSTRUCTION that ends every prompt (None: keep it); the
    records are otherwise identical, so a model's pass rate can be set by the wording alone."""
    if domain not in _MODULES:
        raise DataError(f"unknown domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    mod = _MODULES[domain]
    records = mod.generate(split, n, seed, mod.DEFAULT_DIFFICULTY if difficulty is None else difficulty, compact)
    if instruction is not None:
        cut = len(mod.INSTRUCTION)
        for r in records:
            if not r["prompt"].endswith(mod.INSTRUCTION):  # pragma: no cover - a generator bug
                raise AssertionError(f"{domain} prompt does not end with its instruction: {r['prompt'][-60:]!r}")
            r["prompt"] = r["prompt"][:-cut] + instruction
    return records


__all__ = ["SPLITS", "DEFAULT_DIFFICULTY", "generate"]
