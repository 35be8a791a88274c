"""Evaluating a policy on every domain's eval splits (one row of the eval matrix)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from megatron_sdpo.chat import record_prompts
from megatron_sdpo.config.schema import eval_samples_per_item
from megatron_sdpo.rollout.base import SamplingConfig
from megatron_sdpo.stopwatch import RunClock


def generate_texts(engine, tokenizer, records: list[dict], sampling: SamplingConfig, batch_size: int):
    """Completions for `records` (sampling.n per record, grouped), generated in batches."""
    out = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        prompts = record_prompts(tokenizer, chunk)
        seed = None if sampling.seed is None else sampling.seed + start
        comps = engine.generate(prompts, replace(sampling, seed=seed))
        for c in comps:
            c.prompt_index += start
        out.extend(comps)
    return out


def evaluate(
    engine,
    tokenizer,
    eval_sets: dict[str, list[dict]],
    *,
    greedy: bool,
    avg_k: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    batched_code: bool = True,
    top_p: float = 1.0,
    between: Callable[[], None] | None = None,
    clock: RunClock | None = None,
) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Accuracy per "domain/split" key (greedy, or avg@k when `greedy` is false: k samples per
    item at `temperature` / `top_p`, the mean of their 0/1 accuracies) and the samples.

    Returns (accuracies, samples) where samples[key] lists {"id", "response", "score"} so a run
    directory keeps what the model answered, not only how often it was right. Each answer is
    scored by its record's own domain (an out-of-domain set keeps its scorer); a set listed by
    several domains (the same records) is generated and scored once. `between` runs before
    every set after the first (the run's stop check: a row of a 2-core SmolLM2 run takes minutes,
    a scheduler's signal must not wait for all of it); it may raise to abandon the row. With
    `clock` each set's generation and scoring is its phase `eval/<key>` (the run's timings).
    """
    accs: dict[str, float] = {}
    samples: dict[str, list[dict]] = {}
    done: dict[str, str] = {}  # records' fingerprint -> the first key evaluated with them
    k = eval_samples_per_item(greedy, avg_k)
    sampling = SamplingConfig(
        n=k, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, greedy=k == 1 and greedy, seed=seed
    )
    for n, (key, records) in enumerate(eval_sets.items()):
        if n and between is not None:
            between()
        if not records:
            continue
        same = done.setdefault(_fingerprint(records), key)
        if same != key:
            accs[key], samples[key] = accs[same], samples[same]
            continue
        with clock.phase(f"eval/{key}") if clock is not None else contextlib.nullcontext():
            comps = generate_texts(engine, tokenizer, records, sampling, batch_size)
            recs = [records[c.prompt_index] for c in comps]
            results = _score(recs, [c.text for c in comps], batched_code)
        scores = [float(r.score >= 1.0) for r in results]  # accuracy: fully correct answers
        accs[key] = sum(scores) / len(scores)
        samples[key] = [
            {"id": rec.get("id"), "response": c.text, "score": r.score, "truncated": c.truncated}
            for rec, c, r in zip(recs, comps, results, strict=True)
        ]
    return accs, samples


def _fingerprint(records: list[dict]) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True, default=str).encode()).hexdigest()


def _score(records: list[dict], texts: list[str], batched_code: bool) -> list:
    """Scores per record domain (one batch per domain, shared over the ranks), results in the
    input order."""
    from megatron_sdpo.rollout.scoring import score_shared

    out: list = [None] * len(records)
    for domain in dict.fromkeys(r["domain"] for r in records):
        idx = [i for i, r in enumerate(records) if r["domain"] == domain]
        results = score_shared(domain, [texts[i] for i in idx], [records[i] for i in idx], batched_code=batched_code)
        for i, r in zip(idx, results, strict=True):
            out[i] = r
    return out


def load_eval_sets(cfg) -> dict[str, list[dict]]:
    """Every domain's eval splits of a RunConfig, keyed "domain/split" (the eval-matrix columns).
    A split with `extra_files` holds its `source`'s records and then each extra file's (AIME24 +
    AIME25 as one in-domain math set). Each record is shown its own domain's shots: an MMLU set
    under math is prompted with the science examples' answer format, not the math ones."""
    from megatron_sdpo.data.sources import load_source, with_shots

    shots = {d: dcfg.shots for d, dcfg in cfg.domains.items()}

    def shown(records: list[dict]) -> list[dict]:
        return [with_shots([r], shots.get(r["domain"], ()))[0] for r in records]

    def split_records(src, domain: str, split: str) -> list[dict]:
        records = load_source(src, domain, split, seed=cfg.seed + 1)
        for path in src.extra_files:
            more = load_source(replace(src, source=path, extra_files=[]), domain, split, seed=cfg.seed + 1)
            # Ids key the eval samples and the drift probes: a file's row-index ids ("aime-0")
            # would collide with the first file's, so a clashing id gets the file's name.
            seen = {r.get("id") for r in records}
            more = [{**r, "id": f"{Path(path).stem}:{r.get('id')}"} if r.get("id") in seen else r for r in more]
            records = records + more
        return shown(records)

    return {
        f"{domain}/{split}": split_records(src, domain, split)
        for domain, dcfg in cfg.domains.items()
        for split, src in dcfg.eval.items()
    }


def evaluate_config(
    engine,
    tokenizer,
    eval_sets: dict[str, list[dict]],
    cfg,
    *,
    seed: int,
    between: Callable[[], None] | None = None,
    clock: RunClock | None = None,
):
    """`evaluate` with the settings of a RunConfig's `eval`, `rollout` and `rewards` sections."""
    e = cfg.eval
    return evaluate(
        engine,
        tokenizer,
        eval_sets,
        greedy=e.greedy,
        avg_k=e.avg_k,
        max_new_tokens=e.max_new_tokens,
        temperature=cfg.rollout.temperature if e.temperature is None else e.temperature,
        top_p=e.top_p,
        batch_size=e.batch_size,
        seed=seed,
        batched_code=cfg.rewards.batched_code,
        between=between,
        clock=clock,
    )
