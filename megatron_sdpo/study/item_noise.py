"""Whether a study's benchmark can show what it measures: every arm's in-stage gain per domain
against the noise of its eval items.

A domain passes for an arm when its in-stage gain (ID accuracy after the stage minus before) is
positive in at least 5/6 of the seeds (`stats.enough_agree`) and the mean over seeds is above
`K_SE` item standard errors. One run's item standard error is that of a paired difference over
the same n items, sd(after_i - before_i) / sqrt(n) (n - 1 in the sd); the mean over S seeds has
sqrt(sum of the squared run errors) / S. It is what the gain would scatter by had the items been
drawn afresh, whether or not this study's items are a whole (exhaustive) space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megatron_sdpo.study import stats
from megatron_sdpo.study.metrics import RunView, in_stage_gain


class StudyRun(Protocol):
    """What the check reads of a study's run (findings.StudyRun has it)."""

    arm: str
    view: RunView


K_SE = 3.0


def paired_item_se(before: np.ndarray, after: np.ndarray) -> float | None:
    """sd(after_i - before_i) / sqrt(n) over the same items; None without at least 2 paired items."""
    if len(before) != len(after) or len(before) < 2:
        return None
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    return float(d.std(ddof=1) / math.sqrt(len(d)))


def run_gain(run: StudyRun, domain: str) -> tuple[float | None, float | None]:
    """(in-stage gain, its paired item standard error) of `domain` in one run."""
    view = run.view
    gain = in_stage_gain(view, domain)
    col = f"{domain}/id"
    rows = view.matrix.rows
    for i, name in enumerate(rows[1:], start=1):  # row 0 is the base
        if name != domain:
            continue
        before = view.item_scores.get(rows[i - 1], {}).get(col)
        after = view.item_scores.get(name, {}).get(col)
        se = None if before is None or after is None else paired_item_se(before, after)
        return gain, se
    return gain, None


@dataclass(frozen=True)
class GainCheck:
    arm: str
    domain: str
    gains: tuple[float, ...]
    positive: int
    mean: float
    item_se: float | None  # of the mean over seeds
    passed: bool


def check_gains(runs: Sequence[StudyRun], domains: Sequence[str]) -> list[GainCheck]:
    """One GainCheck per (arm, domain) with a gain in at least one run, arms in first-seen order."""
    out = []
    for arm in dict.fromkeys(r.arm for r in runs):
        mine = [r for r in runs if r.arm == arm]
        for domain in domains:
            pairs = [run_gain(r, domain) for r in mine]
            gains = tuple(g for g, _ in pairs if g is not None)
            if not gains:
                continue
            ses = [se for g, se in pairs if g is not None and se is not None]
            item_se = math.sqrt(math.fsum(se * se for se in ses)) / len(gains) if len(ses) == len(gains) else None
            mean = math.fsum(gains) / len(gains)
            positive = sum(1 for g in gains if g > 0)
            passed = stats.enough_agree(positive, len(gains)) and item_se is not None and mean > K_SE * item_se
            out.append(GainCheck(arm, domain, gains, positive, mean, item_se, passed))
    return out


def markdown(checks: Sequence[GainCheck]) -> list[str]:
    """The study.md section (empty without checks)."""
    if not checks:
        return []
    lines = [
        "## In-stage gains against item noise",
        "",
        f"Does the benchmark show learning? A domain passes when its in-stage gain is positive in at least 5/6 of "
        f"the seeds and its mean is above {K_SE:g} item standard errors (of the mean: the runs' paired "
        "sd(after_i − before_i)/√n combined in quadrature, over the number of seeds).",
        "",
        "| arm | domain | gain per seed | positive | mean | item SE | passes |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        se = "–" if c.item_se is None else f"{c.item_se:.4f}"
        seeds = ", ".join(f"{g:+.3f}" for g in c.gains)
        lines.append(
            f"| {c.arm} | {c.domain} | {seeds} | {c.positive}/{len(c.gains)} | {c.mean:+.3f} | {se} | "
            f"{'yes' if c.passed else 'no'} |"
        )
    return lines + [""]
