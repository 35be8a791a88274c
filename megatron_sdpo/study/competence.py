"""Is the self-teacher competent? SDPO's precondition, measured on one model, preset and domain.

SDPO assumes that the model re-prompted with privileged context (a successful sibling, the
verifier's feedback on a failed attempt, or both) is a better policy than the student on the same
prompt. The probe samples the student on P prompts (n samples each, the preset's rollout
sampling), builds every kind of context the preset's templates can write from those samples, as
the trainer does, samples the same model once per context, and scores everything with the
domain's verifier:

    student pass rate          per prompt, the share of its n samples the verifier accepts
    teacher pass rate (kind)   per prompt, the share of its re-prompted samples accepted, over
                               the prompts with at least one context of that kind
    student pass, same prompts per prompt, the share of a second, independent draw of n student
                               samples accepted: the samples that built the contexts also chose
                               the prompts (a sibling context exists only where one of them
                               passed), so their own pass rate on those prompts is biased upward
                               (for a true rate p, E[k/n | k >= 1] = p / (1 - (1 - p)^n)); it is
                               kept as `student_pass_selecting`, the comparator before this fix
    difference                 per prompt teacher - student (the independent draw), a t interval
                               over those prompts (stats.paired_summary)
    copies                     re-prompted answers equal to the quoted sibling's response
                               (whitespace aside): a pass that reads its answer off the context
    gain (rewarded/unrewarded) per sample with a context, the mean per-token log-probability of
                               its own response under the teacher prompt minus under the student
                               prompt; their gap is the trainer's `teacher/gain_gap`

Kinds: "sibling" (a successful sibling other than the sample itself, the first one), "feedback"
(the verifier's feedback on the sample's failed attempt), "both" (a failed sample with both).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_sdpo.algorithms.context import (
    ContextTemplates,
    build_teacher_contexts,
    quoted_siblings,
    truncate_context_ids,
)
from megatron_sdpo.chat import encode_prompts, record_prompts
from megatron_sdpo.rollout.base import RolloutEngine, SamplingConfig
from megatron_sdpo.study.stats import paired_summary

KINDS = ("sibling", "feedback", "both")

Score = Callable[[list[str], list[dict]], list]  # (texts, records) -> RewardResults
Logprobs = Callable[[list[list[int]], list[list[int]]], list[list[float]]]  # (prompts, responses) -> per token


def kind_templates(base: ContextTemplates, kind: str) -> ContextTemplates:
    """The preset's templates writing one kind of context only."""
    if kind == "sibling":
        return dataclasses.replace(base, use_solution=True, use_feedback=False)
    if kind == "feedback":
        return dataclasses.replace(base, use_solution=False, use_feedback=True)
    if kind == "both":
        return dataclasses.replace(base, use_solution=True, use_feedback=True, feedback_only_without_solution=False)
    raise ValueError(f"unknown context kind {kind!r}; choose from {', '.join(KINDS)}")


def first_sibling(rewards: Sequence[float], group_size: int, threshold: float) -> list[int | None]:
    """Per sample, the sibling `build_teacher_contexts` quotes without an rng (None: none)."""
    return quoted_siblings([r >= threshold for r in rewards], group_size)


def _normalized(text: str) -> str:
    return " ".join(text.split())


def _interval(diffs: list[float]) -> dict:
    if not diffs:
        return {"n": 0, "mean": None, "lo": None, "hi": None}
    s = paired_summary(diffs)
    return {"n": s.n, "mean": s.mean, "lo": s.lo, "hi": s.hi}


def probe(
    engine,
    tokenizer,
    records: list[dict],
    *,
    samples: int,
    sampling: SamplingConfig,
    templates: ContextTemplates,
    score: Score,
    feedbacks: Callable[[list, list[bool]], list[str | None]] | None = None,
    logprobs: Logprobs | None = None,
    max_context_tokens: int | None = None,
    truncation: str = "left",
) -> dict:
    """The probe's table (module docstring) for `records` (one domain's prompts).

    engine: a RolloutEngine; score: the domain's verifier over (texts, records); feedbacks: the
    teacher's feedback texts from (results, truncated) (None: each result's own feedback);
    logprobs: per-token log-probabilities of responses after prompts (None: no gains)."""
    if samples < 2:
        raise ValueError("samples must be >= 2: a sibling is another sample of the same prompt")
    t0 = time.perf_counter()
    n_prompts = len(records)
    prompt_ids = record_prompts(tokenizer, records)
    student = engine.generate(prompt_ids, dataclasses.replace(sampling, n=samples))
    recs = [records[c.prompt_index] for c in student]
    texts = [c.text for c in student]
    results = score(texts, recs)
    threshold = templates.success_threshold
    rewards = [float(r.score) for r in results]
    passed = [r >= threshold for r in rewards]
    fb = feedbacks(results, [c.truncated for c in student]) if feedbacks else [r.feedback for r in results]
    student_pass = [sum(passed[k * samples : (k + 1) * samples]) / samples for k in range(n_prompts)]
    # The comparator: the student's rate per prompt from samples that did not select the prompt
    # (module docstring). Its seed follows the kinds' (seed + 1 .. seed + len(KINDS)).
    fresh_seed = None if sampling.seed is None else sampling.seed + 1 + len(KINDS)
    fresh = engine.generate(prompt_ids, dataclasses.replace(sampling, n=samples, seed=fresh_seed))
    fresh_ok = [
        float(r.score) >= threshold for r in score([c.text for c in fresh], [records[c.prompt_index] for c in fresh])
    ]
    fresh_pass = [0.0] * n_prompts
    for c, ok in zip(fresh, fresh_ok, strict=True):
        fresh_pass[c.prompt_index] += ok / samples
    sibling_of = first_sibling(rewards, samples, threshold)
    out: dict = {
        "prompts": n_prompts,
        "samples_per_prompt": samples,
        "student_pass": sum(student_pass) / max(n_prompts, 1),
        "kinds": {},
    }
    pr = _Probe(
        engine,
        tokenizer,
        recs,
        student,
        student_pass,
        fresh_pass,
        sibling_of,
        passed,
        samples,
        threshold,
        score,
        logprobs,
        prompt_ids,
        max_context_tokens,
        truncation,
    )
    for k_index, kind in enumerate(KINDS):
        contexts = build_teacher_contexts(
            [r["prompt"] for r in recs],
            texts,
            rewards,
            fb,
            group_size=samples,
            templates=kind_templates(templates, kind),
        )
        if kind == "both":  # a failed sample with a sibling *and* feedback; the rest is another kind
            contexts = [
                c if (sibling_of[i] is not None and not passed[i] and fb[i]) else None for i, c in enumerate(contexts)
            ]
        seed = None if sampling.seed is None else sampling.seed + 1 + k_index
        out["kinds"][kind] = _kind_row(pr, kind, contexts, dataclasses.replace(sampling, n=1, seed=seed))
    out["seconds"] = time.perf_counter() - t0
    return out


@dataclasses.dataclass
class _Probe:
    """What every kind's row reads: the student's samples and how they scored."""

    engine: RolloutEngine
    tokenizer: Any
    recs: list  # the record of each sample
    student: list  # Completions, samples of a prompt consecutive
    student_pass: list  # per prompt, from the samples that build the contexts (and select the prompts)
    fresh_pass: list  # per prompt, from an independent draw: the comparator
    sibling_of: list  # per sample: the quoted sibling's index or None
    passed: list  # per sample
    samples: int
    threshold: float
    score: Score
    logprobs: Logprobs | None
    prompt_ids: list  # per prompt
    max_context_tokens: int | None
    truncation: str


def _kind_row(pr: _Probe, kind: str, contexts: list[str | None], sampling: SamplingConfig) -> dict:
    """One kind's numbers over the samples that have its context."""
    rows = [i for i, c in enumerate(contexts) if c is not None]
    prompts_with = sorted({i // pr.samples for i in rows})
    row: dict = {
        "samples": len(rows),
        "prompts": len(prompts_with),
        "prompt_share": len(prompts_with) / max(len(pr.student_pass), 1),
    }
    if not rows:
        return {
            **row,
            "teacher_pass": None,
            "student_pass": None,
            "student_pass_selecting": None,
            "difference": _interval([]),
            "copies": 0,
            "copy_share": None,
        }
    teacher_ids = [
        truncate_context_ids(ids, pr.max_context_tokens, pr.truncation)
        for ids in encode_prompts(
            pr.tokenizer, [str(contexts[i]) for i in rows], [pr.recs[i].get("history", ()) for i in rows]
        )
    ]
    answers = pr.engine.generate(teacher_ids, sampling)
    results = pr.score([a.text for a in answers], [pr.recs[i] for i in rows])
    per_prompt: dict[int, list[bool]] = {}
    for i, r in zip(rows, results, strict=True):
        per_prompt.setdefault(i // pr.samples, []).append(float(r.score) >= pr.threshold)
    t_pass = {p: sum(v) / len(v) for p, v in per_prompt.items()}
    copies = 0
    if kind != "feedback":
        copies = sum(
            1
            for i, a in zip(rows, answers, strict=True)
            if pr.sibling_of[i] is not None and _normalized(a.text) == _normalized(pr.student[pr.sibling_of[i]].text)
        )
    row.update(
        teacher_pass=sum(t_pass.values()) / len(t_pass),
        student_pass=sum(pr.fresh_pass[p] for p in prompts_with) / len(prompts_with),
        student_pass_selecting=sum(pr.student_pass[p] for p in prompts_with) / len(prompts_with),
        difference=_interval([t_pass[p] - pr.fresh_pass[p] for p in prompts_with]),
        copies=copies,
        copy_share=copies / len(rows),
    )
    if pr.logprobs is not None:
        row.update(_gains(pr, rows, teacher_ids))
    return row


def _gains(pr: _Probe, rows: list[int], teacher_ids: list[list[int]]) -> dict:
    """Mean per-token log-probability gain of each sample's own response under its teacher
    prompt over its student prompt, averaged over the accepted and the rejected samples."""
    assert pr.logprobs is not None
    responses = [list(pr.student[i].token_ids) for i in rows]
    with_ctx = pr.logprobs(teacher_ids, responses)
    without = pr.logprobs([pr.prompt_ids[pr.student[i].prompt_index] for i in rows], responses)
    gains: dict[bool, list[float]] = {True: [], False: []}
    for i, t, s, resp in zip(rows, with_ctx, without, responses, strict=True):
        if resp:
            gains[bool(pr.passed[i])].append(sum(a - b for a, b in zip(t, s, strict=True)) / len(resp))
    rewarded = sum(gains[True]) / len(gains[True]) if gains[True] else None
    unrewarded = sum(gains[False]) / len(gains[False]) if gains[False] else None
    gap = None if rewarded is None or unrewarded is None else rewarded - unrewarded
    return {"gain_rewarded": rewarded, "gain_unrewarded": unrewarded, "gain_gap": gap}


# -- the command -------------------------------------------------------------------------------
def probe_records(cfg, domain: str, split: str, prompts: int) -> list[dict]:
    """The first `prompts` records of `domain`'s train split or of one of its eval splits, as a
    run shows them (the domain's worked examples as earlier turns)."""
    from megatron_sdpo.data.sources import load_source
    from megatron_sdpo.errors import ConfigError
    from megatron_sdpo.evaluation import load_eval_sets

    if domain not in cfg.domains:
        raise ConfigError(f"unknown domain {domain!r} for this preset; it has {', '.join(cfg.domains)}")
    d = cfg.domains[domain]
    if split == "train":
        records = load_source(d.train, domain, "train", seed=cfg.seed, shots=d.shots)
    elif split in d.eval:
        records = load_eval_sets(cfg)[f"{domain}/{split}"]
    else:
        raise ConfigError(f"unknown split {split!r} of {domain}; choose train or {', '.join(d.eval)}")
    return records[:prompts]


def run_probe(
    cfg,
    domain: str,
    *,
    split: str = "train",
    prompts: int = 200,
    samples: int | None = None,
    gains: bool = True,
    work_dir: str,
) -> dict:
    """The probe of `cfg.model.path` on `domain` with the preset's rollout sampling and context
    templates; `samples` defaults to the preset's group size."""
    from megatron_sdpo import builders
    from megatron_sdpo.algorithms.context import teacher_feedbacks, templates_for
    from megatron_sdpo.chat import set_template_kwargs
    from megatron_sdpo.interfaces.backend import SequenceBatch
    from megatron_sdpo.rewards import score_batch

    records = probe_records(cfg, domain, split, prompts)
    model_path = builders.resolve_model_path(cfg)
    tokenizer = set_template_kwargs(builders.load_tokenizer(model_path), cfg.model.chat_template_kwargs)
    ctx = cfg.algorithm.sdpo.context

    def feedbacks(results, truncated):  # as the trainer writes them (trainer.teacher.SelfTeacher.attach)
        return teacher_feedbacks(ctx, domain, results, truncated)

    logprobs = None
    if gains:
        # Before the engine, as in a run: models.hf_model says why the order matters.
        backend = builders.make_backend(cfg, model_path, tokenizer)

        def logprobs(prompt_ids, responses):
            lp = backend.logprobs(SequenceBatch(prompt_ids, responses))
            return [lp[i, : len(r)].tolist() for i, r in enumerate(responses)]

    engine = builders.make_rollout(cfg, model_path, tokenizer, work_dir)

    sampling = SamplingConfig(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.seed,
    )
    templates = templates_for(ctx, domain)
    out = probe(
        engine,
        tokenizer,
        records,
        samples=samples or cfg.algorithm.group_size,
        sampling=sampling,
        templates=templates,
        score=lambda texts, recs: score_batch(domain, texts, recs, batched_code=cfg.rewards.batched_code),
        feedbacks=feedbacks,
        logprobs=logprobs,
        max_context_tokens=ctx.max_context_tokens,
        truncation=ctx.truncation,
    )
    builds = {
        "sibling": templates.use_solution,
        "feedback": templates.use_feedback,
        "both": templates.use_solution and templates.use_feedback,
    }
    for kind, row in out["kinds"].items():
        row["preset_builds"] = builds[kind]
    return {"model": str(cfg.model.path), "domain": domain, "split": split, **out}


def _num(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def format_probe(out: dict) -> str:
    """The probe's table in markdown."""
    lines = [
        f"{out['domain']} ({out['split']}), {out['prompts']} prompts x {out['samples_per_prompt']} samples: "
        f"student pass rate {_num(out['student_pass'])}",
        "",
        "| context | built by the preset | prompts with it | teacher pass | student pass, same prompts | "
        "difference [95% CI] | copies of the sibling | gain rewarded | gain unrewarded | gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in out["kinds"].items():
        d = r["difference"]
        diff = "–" if d["mean"] is None else f"{d['mean']:+.3f} [{_num(d['lo'])}, {_num(d['hi'])}]"
        lines.append(
            f"| {kind} | {'yes' if r.get('preset_builds', True) else 'no'} | {r['prompts']} "
            f"({r['prompt_share']:.0%}) | "
            f"{_num(r['teacher_pass'])} | {_num(r['student_pass'])} | {diff} | {r['copies']} of {r['samples']} | "
            f"{_num(r.get('gain_rewarded'))} | {_num(r.get('gain_unrewarded'))} | {_num(r.get('gain_gap'))} |"
        )
    return "\n".join(lines)


def _delta(row: dict) -> str:
    d = row["difference"]
    return "–" if d["mean"] is None else f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def probe_table(folder: Path) -> list[str]:
    """docs/findings.md's table of an exported set of probes: `folder`/probes.json lists them
    with their wall times and, where a name is not `<domain>_before` / `<domain>_after` (the
    checkpoint that starts / ends the domain's stage), the checkpoint in words ("checkpoint");
    each probe's numbers are in `folder`/<name>.json."""
    import json

    from megatron_sdpo.errors import UserError

    try:
        index = json.loads((folder / "probes.json").read_text())
        probes = {
            name: (meta, json.loads((folder / f"{name}.json").read_text())) for name, meta in index["probes"].items()
        }
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{folder}: not a folder of exported probes ({' '.join(str(exc).split())})") from None
    lines = [
        "| domain | checkpoint | student pass | sibling: prompts, teacher vs student, Δ [95% CI] | copies | "
        "feedback: Δ [95% CI] | both: Δ [95% CI] | gain gap (sibling) | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (meta, out) in probes.items():
        k = out["kinds"]
        sib = k["sibling"]
        when = meta.get("checkpoint") or {"before": "stage start", "after": "stage end"}.get(
            name.rsplit("_", 1)[-1], name
        )
        lines.append(
            f"| {out['domain']} | {when} | {_num(out['student_pass'])} | {sib['prompts']} ({sib['prompt_share']:.0%}), "
            f"{_num(sib['teacher_pass'])} vs {_num(sib['student_pass'])}, {_delta(sib)} | "
            f"{sib['copies']} of {sib['samples']} | {_delta(k['feedback'])} | {_delta(k['both'])} | "
            f"{_num(sib.get('gain_gap'))} | {meta['wall_s']} s |"
        )
    return lines


# -- SDPO's regime, as a rule on the probe (post hoc) --------------------------------------------
# The rule (docs/findings.md): the sibling context raises the re-prompted pass rate over the
# student's on the same prompts by at least REGIME_DELTA, with fewer than COPY_LIMIT of its answers
# copies of the quoted sibling. Chosen after the first tiny and SmolLM2 probes were seen; judged on
# the interval: held when the whole 95% interval is at or above REGIME_DELTA, not held when it is
# wholly below it (or the copies reach the limit), undecided otherwise.
REGIME_DELTA, COPY_LIMIT = 0.10, 0.5


def regime(row: dict) -> str:
    """The rule's outcome for one kind's row of a probe with an independent comparator."""
    d = row["difference"]
    if d["mean"] is None or d["lo"] is None:
        return "undecided"
    if (row.get("copy_share") or 0.0) >= COPY_LIMIT or d["hi"] < REGIME_DELTA:
        return "not held"
    return "held" if d["lo"] >= REGIME_DELTA else "undecided"


def selection_bias(mean: float, share: float, n: int) -> float | None:
    """The old comparator's expected bias on the prompts with a sibling, from a beta-binomial fit
    to what an old probe kept: the student's pass rate over all prompts (`mean`) and the share of
    prompts with at least one of n samples accepted (`share`). The selecting samples' rate on
    those prompts is mean / share (prompts without a success add nothing); an independent draw's
    is E[p | k >= 1] = (mean − E[p (1 − p)^n]) / share; the bias is E[p (1 − p)^n] / share. None
    where no beta-binomial has that mean and share (share outside (mean, 1 − (1 − mean)^n))."""
    if not 0.0 < mean < 1.0 or not mean < share < 1.0 - (1.0 - mean) ** n:
        return None

    def zero_share(c: float) -> float:  # P(k = 0) = B(a, b + n) / B(a, b), a = mean·c, b = (1 − mean)·c
        b = (1.0 - mean) * c
        return math.prod((b + j) / (c + j) for j in range(n))

    lo, hi = -12.0, 12.0  # log concentration; P(k = 0) falls from 1 − mean to (1 − mean)^n as c grows
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1.0 - zero_share(math.exp(mid)) < share else (lo, mid)
    c = math.exp((lo + hi) / 2)
    b = (1.0 - mean) * c
    tail = mean * math.prod((b + j) / (c + 1 + j) for j in range(n))  # E[p (1 − p)^n] = B(a+1, b+n) / B(a, b)
    return tail / share


def regime_table(folder: Path) -> list[str]:
    """docs/findings.md's regime block for an exported set of probes: per probe, the comparator,
    the sibling context's Δ with its interval and copies, the old comparator's bias (measured
    where the probe drew the student twice, else the beta-binomial estimate) and the rule's
    outcome (`regime`; not judged on a probe whose comparator is the selecting samples)."""
    import json

    index = json.loads((folder / "probes.json").read_text())
    lines = [
        "| domain | checkpoint | comparator | sibling: Δ [95% CI] | copies | old comparator's bias | Δ + bias "
        f"(estimate) | rule (post hoc): Δ ≥ {REGIME_DELTA:.2f}, copies < {COPY_LIMIT:.0%} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, meta in index["probes"].items():
        out = json.loads((folder / f"{name}.json").read_text())
        sib = out["kinds"]["sibling"]
        when = meta.get("checkpoint") or {"before": "stage start", "after": "stage end"}.get(
            name.rsplit("_", 1)[-1], name
        )
        copies = "–" if sib["copy_share"] is None else f"{sib['copy_share']:.0%}"
        if sib.get("student_pass_selecting") is not None:
            bias = f"{sib['student_pass_selecting'] - sib['student_pass']:+.3f} (measured)"
            comparator, corrected, rule = "independent draw", "–", f"*{regime(sib)}*"
        else:
            est = selection_bias(out["student_pass"], sib["prompt_share"], out["samples_per_prompt"])
            d = sib["difference"]["mean"]
            bias = "–" if est is None else f"{est:+.3f} (beta-binomial estimate)"
            corrected = "–" if est is None or d is None else f"{d + est:+.3f}"
            comparator, rule = "the selecting samples (biased up)", "not judged: re-run with an independent draw"
        lines.append(
            f"| {out['domain']} | {when} | {comparator} | {_delta(sib)} | {copies} | {bias} | {corrected} | {rule} |"
        )
    return lines
