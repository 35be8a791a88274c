"""Statistics of a multi-seed study: paired differences against a baseline arm, their 95%
t-interval, the sign count, the verdict rule and the pilot's seed count (the bootstrap designs,
equivalence and Holm: study/inference.py).

Pure functions over numbers; no run directories here (study/metrics.py reads those). The
Student-t and normal quantiles are computed here (regularized incomplete beta by its continued
fraction, then bisection) so the package needs no scipy.

Verdict (issue 25): with d_i = arm_i - baseline_i over the n paired seeds and the paper's
direction s in {+1, -1},
  established   the 95% t-interval excludes 0 on the side of s and at least 5/6 of the seeds
                have sign(d_i) = s (5 of 6; ceil(5n/6) for other n);
  contradicted  the same with -s;
  inconclusive  otherwise (also with fewer than 2 seeds: no interval).
A metric with no stated direction is "descriptive". A difference of exactly 0 agrees with
neither side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ESTABLISHED, CONTRADICTED, INCONCLUSIVE, DESCRIPTIVE = "established", "contradicted", "inconclusive", "descriptive"
# The share of seeds that must agree in sign: 5 of 6.
AGREE_NUM, AGREE_DEN = 5, 6


# -- distributions ------------------------------------------------------------------------------
def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    # The fraction converges fast on the side of the mean a / (a + b): use the symmetry there.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _invert(cdf: Callable[[float], float], p: float) -> float:
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    lo, hi = -1.0, 1.0
    while cdf(lo) > p:
        lo *= 2.0
    while cdf(hi) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    return _invert(lambda t: t_cdf(t, df), p)


def normal_quantile(p: float) -> float:
    return _invert(normal_cdf, p)


# -- paired differences ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PairedSummary:
    """Mean paired difference over seeds with its 95% t-interval (None with fewer than 2 seeds)."""

    n: int
    mean: float
    sd: float | None
    lo: float | None
    hi: float | None
    positive: int  # seeds with d_i > 0
    negative: int  # seeds with d_i < 0


def paired_summary(diffs: Sequence[float], level: float = 0.95) -> PairedSummary:
    """mean(d) +- t_{(1+level)/2, n-1} * sd(d) / sqrt(n), sd with n - 1 in the denominator."""
    d = [float(x) for x in diffs]
    n = len(d)
    if n == 0:
        raise ValueError("paired_summary needs at least one difference")
    mean = math.fsum(d) / n
    pos, neg = sum(1 for x in d if x > 0), sum(1 for x in d if x < 0)
    if n < 2:
        return PairedSummary(n, mean, None, None, None, pos, neg)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return PairedSummary(n, mean, sd, mean - half, mean + half, pos, neg)


def enough_agree(count: int, n: int) -> bool:
    """At least 5/6 of the n seeds (integer arithmetic: 6 * count >= 5 * n)."""
    return n > 0 and AGREE_DEN * count >= AGREE_NUM * n


def verdict(summary: PairedSummary, direction: int | None) -> str:
    """The verdict rule of the module docstring; `direction` +1 / -1: the sign of arm - baseline
    the paper reports, None: the paper states none."""
    return sided_verdict(summary, direction, summary.lo, summary.hi)


def sided_verdict(summary: PairedSummary, direction: int | None, lo: float | None, hi: float | None) -> str:
    """The rule with the interval [lo, hi] at whatever level the caller judges at (95% above,
    Holm's levels in study/inference.py)."""
    if direction is None:
        return DESCRIPTIVE
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1, -1 or None, got {direction!r}")
    if lo is None or hi is None:
        return INCONCLUSIVE
    agree, oppose = (summary.positive, summary.negative) if direction > 0 else (summary.negative, summary.positive)
    if (lo > 0 if direction > 0 else hi < 0) and enough_agree(agree, summary.n):
        return ESTABLISHED
    if (hi < 0 if direction > 0 else lo > 0) and enough_agree(oppose, summary.n):
        return CONTRADICTED
    return INCONCLUSIVE


# -- pilot ----------------------------------------------------------------------------------------
def seeds_needed(sd: float, detect: float, *, power: float = 0.8, level: float = 0.95, max_n: int = 10_000) -> int:
    """Seeds for a paired two-sided t-test at `level` to detect a mean difference `detect` with
    `power`, given the paired SD `sd` of a pilot: the smallest n >= 2 with
    (t_{(1+level)/2, n-1} + t_{power, n-1}) * sd / sqrt(n) <= detect."""
    if detect <= 0:
        raise ValueError(f"the detectable difference must be positive, got {detect}")
    if sd < 0 or not math.isfinite(sd):
        raise ValueError(f"the pilot's SD must be finite and >= 0, got {sd}")
    if sd == 0:
        return 2
    # The normal-theory n is a lower bound (t quantiles exceed z quantiles): start there.
    z = normal_quantile(0.5 + level / 2.0) + normal_quantile(power)
    start = max(2, math.ceil((z * sd / detect) ** 2) - 1)
    for n in range(min(start, max_n), max_n + 1):
        if (t_quantile(0.5 + level / 2.0, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n) <= detect:
            return n
    return max_n
