"""The safeguard study's readings beyond its pre-registered analysis (study/preregistered.py),
each computed from the exported runs and labelled post hoc where docs/findings.md shows it:

- `collapse_table`: per arm, the frozen-teacher collapse signature: the training reward's change
  over the stage (last 3 steps' mean minus the first 3's: the collapse monitor's windows), how
  many seeds fell, the repeated-`\\boxed` share's peak and change, and the teacher's endorsement
  of repeated-`\\boxed` tokens (described: the pre-registration lists none of these);
- `table`: the paper's specialization claim judged on this study's SDPO₀ − GRPO in-stage math
  gain by the project's verdict rule (a secondary the pre-registration describes, judged here
  after the data); the λ-hybrid against the dilution midpoint; the two failed safeguards' upper
  bounds against the effect that matters; the sd the seed count was sized from, beside the
  confirmatory data's and the primary's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_sdpo.study import paper, stats
from megatron_sdpo.study.preregistered import (
    BASELINE,
    DETECT,
    GAIN,
    REFERENCE,
    VARIANTS,
    Z_80,
    Z_975,
    analyse,
    cell,
    endpoint,
    paired,
)

HYBRID, LAMBDA = "hybrid_frozen", 0.5  # the arm and its λ (the preset's algorithm.sdpo.hybrid_lambda)
Runs = Sequence[tuple[str, int, dict]]


def _ci(d: Sequence[float]) -> str:
    if not d:
        return "–"
    s = stats.paired_summary(d)
    return f"{s.mean:+.3f}" + ("" if s.lo is None else f" [{s.lo:+.3f}, {s.hi:+.3f}]")


def collapse_table(runs: Runs) -> list[str]:
    """docs/findings.md's safeguard-collapse block (module docstring)."""
    lines = [
        "| arm | seeds | training reward, last 3 − first 3 steps, 95% | seeds where it fell | repeated `\\boxed`, "
        "peak share | repeated `\\boxed`, last − first step | teacher endorsement of repeated `\\boxed`, 95% (runs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in dict.fromkeys(a for a, _, _ in runs):
        vals = [v for a, _, v in runs if a == arm]
        change = [x for v in vals if (x := v.get("reward_change")) is not None]
        endorse = [x for v in vals if (x := v.get("teacher_artifact_endorsement")) is not None]
        lines.append(
            f"| `{arm}` | {len(vals)} | {_ci(change)} | {sum(x < 0 for x in change)} of {len(change)} | "
            f"{cell([v.get('boxed_repeat_max') for v in vals], '{:.3f}')} | "
            f"{cell([v.get('boxed_repeat_gain') for v in vals])} | "
            f"{_ci(endorse)} ({len(endorse)}) |"
        )
    return lines


def _reading(lo: float | None, hi: float | None, at: float, above: str, below: str, across: str) -> str:
    if lo is not None and lo > at:
        return above
    if hi is not None and hi < at:
        return below
    return across


def table(runs: Runs, tuning: Runs) -> list[str]:
    """docs/findings.md's safeguard-post-hoc block (module docstring): one row per reading."""
    lines = ["| reading (post hoc) | mean [95% t-interval] | seeds | what the interval says |", "|---|---|---|---|"]
    gains = paired(runs, REFERENCE, BASELINE, lambda v: v.get(GAIN))
    gain = stats.paired_summary(gains)
    direction = paper.direction(GAIN, BASELINE)
    agree = gain.positive if direction == 1 else gain.negative
    lines.append(
        f"| in-stage math gain, SDPO₀ − GRPO (paper: SDPO specializes faster, {paper.PAPER[GAIN].stated}) | "
        f"{_ci(gains)} | {agree} of {gain.n} in the paper's direction | *{stats.verdict(gain, direction)}* by the "
        "study rule |"
    )
    # λ = 0.5: D = E(hybrid) − E(SDPO₀) above half the gap E(GRPO) − E(SDPO₀) is the same event as
    # E(hybrid) above (1 − λ)·E(SDPO₀) + λ·E(GRPO), the endpoint of a plain mixture of the two.
    mid = [h - (LAMBDA * g + (1 - LAMBDA) * s) for h, g, s in _triples(runs, HYBRID, BASELINE, REFERENCE, endpoint)]
    if mid:
        m = stats.paired_summary(mid)
        lines.append(
            f"| E(hybrid) − (E(GRPO) + E(SDPO₀)) / 2: the λ = 0.5 hybrid against the dilution midpoint | "
            f"{_ci(mid)} | {m.positive} of {m.n} above | "
            + _reading(
                m.lo,
                m.hi,
                0.0,
                "above the midpoint",
                "below the midpoint",
                "not resolved from the midpoint: a 50/50 dilution gives this endpoint",
            )
            + " |"
        )
    result = analyse(runs)
    half = result["gate"]["gap"] / 2
    for o in result["outcomes"]:
        if o.arm == HYBRID:
            continue
        d = stats.paired_summary(paired(runs, o.arm, REFERENCE, endpoint))
        lines.append(
            f"| D = E({o.arm}) − E(SDPO₀), against the effect that matters ({half:.3f}) | "
            f"{_ci(paired(runs, o.arm, REFERENCE, endpoint))} | "
            f"{d.positive} of {d.n} above 0 | "
            + _reading(
                d.lo,
                d.hi,
                half,
                "above the effect that matters",
                f"upper bound below {half:.3f}: rules out the effect that matters",
                "does not rule out the effect that matters",
            )
            + " |"
        )
    for label, data in (("tuning", tuning), ("confirmatory", runs)):
        diffs = paired(data, REFERENCE, BASELINE, lambda v: v.get(GAIN))
        s = stats.paired_summary(diffs)
        if s.sd is None:
            continue
        asked = math.ceil(((Z_975 + Z_80) * s.sd / DETECT) ** 2)
        ds = [
            stats.paired_summary(paired(data, v, REFERENCE, endpoint)).sd
            for v in VARIANTS
            if paired(data, v, REFERENCE, endpoint)
        ]
        d_sd = ", ".join("–" if x is None else f"{x:.3f}" for x in ds)
        lines.append(
            f"| sd of the in-stage math gain difference SDPO₀ − GRPO ({label} seeds), which sized N | sd {s.sd:.3f} | "
            f"{s.n} | the rule asks {asked} seeds; the primary's D has sd {d_sd} ({', '.join(VARIANTS)}): N was "
            "not sized from it |"
        )
    return lines


def _triples(runs: Runs, a: str, b: str, c: str, metric) -> list[tuple[float, float, float]]:
    """metric of arms a, b, c on every seed that has all three."""
    by_seed: dict[int, dict[str, dict]] = {}
    for arm, seed, values in runs:
        by_seed.setdefault(seed, {})[arm] = values
    out = []
    for seed in sorted(by_seed):
        row = by_seed[seed]
        if all(x in row for x in (a, b, c)):
            vals = [metric(row[x]) for x in (a, b, c)]
            if None not in vals:
                out.append((vals[0], vals[1], vals[2]))
    return out
