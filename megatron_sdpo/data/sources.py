"""Resolving a config `DataSource` (synthetic suite or a file in a public schema) to records."""

from __future__ import annotations

import random

from megatron_sdpo.errors import DataError


def load_source(source, domain: str, split: str, *, seed: int, shots=()) -> list[dict]:
    """Records for `domain`/`split` from `source` (a `DataSource` config).

    Synthetic sources draw `source.n` records deterministically from the seed (0: every item of
    the split, the same for every seed: exhaustive evaluation); file sources load with the named
    schema and keep `source.n` of them (0 = all), sampled with the seed.
    `source.instruction` (synthetic only) replaces the suite's instruction ending each prompt;
    `source.difficulty` (synthetic only; None: the domain's default) sets the generator's difficulty;
    `source.compact` (synthetic only) draws from the domain's compact surface.
    `source.where` and `source.part` (files only) keep rows by column value and a share of the
    file's questions (`question_share`), before `n` is drawn.
    `shots` (the domain's worked examples, `Shot`s) become every record's earliest "history" turns.
    """
    return with_shots(_load(source, domain, split, seed), shots)


def with_shots(records: list[dict], shots) -> list[dict]:
    """`records` with `shots` (objects with `user` and `assistant` text) as the first turns of
    each record's "history" (before any turns the record brings)."""
    if not shots:
        return records
    turns = [
        t for s in shots for t in ({"role": "user", "content": s.user}, {"role": "assistant", "content": s.assistant})
    ]
    return [{**r, "history": [*turns, *r.get("history", ())]} for r in records]


def _load(source, domain: str, split: str, seed: int) -> list[dict]:
    if source.source == "synthetic":
        from megatron_sdpo.data import synthetic

        return synthetic.generate(
            domain, split, source.n, seed, source.difficulty, instruction=source.instruction, compact=source.compact
        )
    from megatron_sdpo.data.loaders import SCHEMAS, load_records

    schema_domain = SCHEMAS[source.schema][0] if source.schema in SCHEMAS else None
    # An eval split may list another domain's set (out-of-domain evaluation, e.g. MMLU-Redux under
    # math): its records keep their own domain, which scores them.
    keep = domain if split == "train" or schema_domain is None else None
    records: list[dict] = load_records(
        source.source, source.schema, domain=keep, split=split, where=source.where or None
    )
    if source.part is not None:
        lo, hi = source.part
        records = [r for r in records if lo <= question_share(r["prompt"]) < hi]
    if not records:
        chosen = "".join(f" with {k} in {v}" for k, v in source.where.items())
        chosen += f" in part {source.part}" if source.part is not None else ""
        raise DataError(f"{source.source}: no records for domain {domain!r}{chosen}")
    if source.n and source.n < len(records):
        return random.Random(seed).sample(records, source.n)
    return records


def question_share(prompt: str) -> float:
    """Where a question falls in [0, 1): a hash of its text (whitespace collapsed, case folded),
    the same on every machine and run, so a `part` of a file holds whole questions."""
    from megatron_sdpo.data.dataset_files import question_key
    from megatron_sdpo.data.records import unit_hash

    return unit_hash(question_key(prompt))
