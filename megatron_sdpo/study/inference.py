"""What a study may conclude from paired seeds beyond one interval: an equivalence verdict
(two one-sided tests), Holm's step-down control over a finding's secondary metrics, and the
bootstrap designs (items redrawn per seed, or one item draw shared by every seed: crossed).

Verdict with a margin (issue 42), for a paired difference with the paper's direction s, at
confidence level L (0.95 for a primary metric, Holm's adjusted level for a secondary one):
  established   the L t-interval excludes 0 on the side of s and >= 5/6 of the seeds agree;
  contradicted  the same on the other side;
  equivalent    (metrics with a margin m only) both one-sided tests at 1 - L reject a
                difference of m or more (TOST): the (2L - 1) t-interval, 90% for a primary,
                lies inside (-m, m) -- the data rule out an effect of the size the margin
                names, in either direction;
  inconclusive  otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from megatron_sdpo.study import stats

EQUIVALENT = "equivalent"
# Accuracy-type metrics: 0.03 absolute is about two items of 64, more than one item-noise SE on
# the exhaustive splits.
ACCURACY_MARGIN = 0.03
ALPHA = 0.05


def t_pvalue(summary: stats.PairedSummary) -> float | None:
    """Two-sided p of the paired t-test of mean 0 (None with fewer than 2 seeds; 0 or 1 when
    every difference is equal)."""
    if summary.sd is None:
        return None
    if summary.sd == 0.0:
        return 1.0 if summary.mean == 0.0 else 0.0
    t = summary.mean / (summary.sd / math.sqrt(summary.n))
    return 2.0 * (1.0 - stats.t_cdf(abs(t), summary.n - 1))


def interval_at(summary: stats.PairedSummary, level: float) -> tuple[float | None, float | None]:
    """The paired t-interval at `level` (None, None with fewer than 2 seeds)."""
    if summary.sd is None:
        return None, None
    half = stats.t_quantile(0.5 + level / 2.0, summary.n - 1) * summary.sd / math.sqrt(summary.n)
    return summary.mean - half, summary.mean + half


def tost_equivalent(summary: stats.PairedSummary, margin: float, alpha: float = ALPHA) -> bool:
    """Two one-sided t-tests at `alpha` each: H0 mean <= -margin and H0 mean >= margin both
    rejected, i.e. the (1 - 2 alpha) t-interval lies strictly inside (-margin, margin)."""
    if margin <= 0:
        raise ValueError(f"the equivalence margin must be positive, got {margin}")
    lo, hi = interval_at(summary, 1.0 - 2.0 * alpha)
    return lo is not None and hi is not None and -margin < lo and hi < margin


def verdict_at(
    summary: stats.PairedSummary, direction: int | None, *, level: float = 1.0 - ALPHA, margin: float | None = None
) -> str:
    """The module docstring's verdict at confidence `level`."""
    lo, hi = interval_at(summary, level)
    sided = stats.sided_verdict(summary, direction, lo, hi)
    if sided == stats.INCONCLUSIVE and margin is not None and tost_equivalent(summary, margin, alpha=1.0 - level):
        return EQUIVALENT
    return sided


def holm_levels(pvalues: Sequence[float | None], alpha: float = ALPHA) -> list[float]:
    """Holm's step-down: the confidence level each test is judged at. With the m p-values sorted
    ascending, the i-th (from 0) is tested at alpha / (m - i) while every earlier one rejected;
    from the first that does not, every later one keeps that first level (no later rejection is
    possible). A missing p-value (fewer than 2 seeds) takes the strictest level, alpha / m."""
    m = sum(p is not None for p in pvalues)
    levels = [1.0 - alpha / max(m, 1)] * len(pvalues)
    order = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    stopped: float | None = None
    for rank, (p, i) in enumerate(order):
        level_alpha = alpha / (m - rank)
        if stopped is None and p > level_alpha:
            stopped = level_alpha
        levels[i] = 1.0 - (stopped if stopped is not None else level_alpha)
    return levels


def holm_adjusted(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values: max over the earlier sorted ones of min(1, (m - rank) p)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


# -- bootstrap designs ----------------------------------------------------------------------------
class ItemDraws:
    """One draw of every item set a replicate needs, made on first use and then reused: a key
    (an eval column and its item count) maps to indices drawn with replacement."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self._draws: dict = {}

    def get(self, key, n: int) -> np.ndarray:
        if key not in self._draws:
            self._draws[key] = self.rng.integers(0, n, n)
        return self._draws[key]


U = TypeVar("U")


def bootstrap(
    units: Sequence[U],
    paired_diff: Callable[[U, ItemDraws | None], float | np.ndarray],
    *,
    crossed: bool = True,
    n_boot: int = 1000,
    level: float = 1.0 - ALPHA,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of the mean paired difference over `units` (the seeds).

    Each replicate draws len(units) seeds with replacement and calls `paired_diff(unit, draws)`;
    the unit recomputes its difference on the items `draws.get(key, n)` names (both arms of a
    seed on the same items: the pairing). crossed=True: one ItemDraws per replicate, shared by
    every drawn seed -- the design where every seed answers the same items (exhaustive splits),
    so item noise is common to all seeds and does not average out over them. crossed=False: a
    fresh draw per drawn seed (seeds with items of their own). Returns (lo, hi) shaped like one
    `paired_diff` result (NaN where no replicate has a value)."""
    if not units:
        raise ValueError("bootstrap needs at least one seed")
    if n_boot < 1:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    rng = np.random.default_rng(seed)
    n = len(units)
    reps = []
    for _ in range(n_boot):
        picks = rng.integers(0, n, size=n)
        shared = ItemDraws(rng) if crossed else None
        draws = [
            np.asarray(paired_diff(units[i], shared if crossed else ItemDraws(rng)), dtype=np.float64) for i in picks
        ]
        reps.append(np.nanmean(np.stack(draws), axis=0))
    alpha = (1.0 - level) / 2.0
    lo, hi = np.nanquantile(np.stack(reps), [alpha, 1.0 - alpha], axis=0)
    return lo, hi


@dataclass(frozen=True)
class Judgement:
    """One metric of one arm against the baseline: the level it is judged at, its interval
    there, the Holm-adjusted p and the verdict."""

    primary: bool
    level: float
    lo: float | None
    hi: float | None
    p_adjusted: float | None
    verdict: str


def judge_finding(
    summaries: Sequence[stats.PairedSummary | None],
    directions: Sequence[int | None],
    margins: Sequence[float | None],
    primary: int,
) -> list[Judgement]:
    """A finding's metrics (one arm against the baseline): the primary at 95%, the others with
    Holm's levels over the secondaries that have a paper direction (descriptive metrics are not
    tested and keep 95%)."""
    tested = [
        i
        for i, (s, d) in enumerate(zip(summaries, directions, strict=True))
        if i != primary and d is not None and s is not None
    ]
    pvals = [t_pvalue(summaries[i]) for i in tested]  # type: ignore[arg-type]
    levels = dict(zip(tested, holm_levels(pvals), strict=True))
    known = [(i, p) for i, p in zip(tested, pvals, strict=True) if p is not None]
    adjusted = dict(zip([i for i, _ in known], holm_adjusted([p for _, p in known]), strict=True))
    out = []
    for i, (s, d, m) in enumerate(zip(summaries, directions, margins, strict=True)):
        level = levels.get(i, 1.0 - ALPHA)
        if s is None:
            out.append(
                Judgement(i == primary, level, None, None, None, stats.DESCRIPTIVE if d is None else stats.INCONCLUSIVE)
            )
            continue
        lo, hi = interval_at(s, level)
        p = t_pvalue(s) if i == primary else adjusted.get(i)
        out.append(Judgement(i == primary, level, lo, hi, p, verdict_at(s, d, level=level, margin=m)))
    return out
