"""The safeguard study's pre-registered analysis (docs/studies.md, "Pre-registration: safeguarded
self-distillation on SmolLM2-135M"), committed with the design before any confirmatory run.

Per run, the primary endpoint E is the mean of `ood_change/math/near` and `ood_change/math/far`.
Paired by seed:

- the gate: E(SDPO₀) − E(GRPO) < 0 with a one-sided paired t-test p < 0.05; if not, no safeguard
  is judged;
- the primary, per variant V: D_V = E(V) − E(SDPO₀), H₁ D_V > 0, one-sided paired t-tests over
  the family of the variants, Holm-adjusted p < 0.025 and at least ⌈7n/8⌉ of n seeds with
  D_V > 0; the smallest effect that matters is half of the measured gap E(GRPO) − E(SDPO₀);
- the co-primary (for a V that passes): `in_stage_gain/math` of V above 0 (one-sided p < 0.025)
  and non-inferior to SDPO₀'s with margin 0.05 (the lower one-sided 97.5% bound of the paired
  difference above −0.05).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from megatron_sdpo.study import stats
from megatron_sdpo.study.findings import _mean
from megatron_sdpo.study.inference import holm_adjusted

NEAR, FAR, GAIN = "ood_change/math/near", "ood_change/math/far", "in_stage_gain/math"
REFERENCE, BASELINE = "sdpo_frozen", "grpo"
VARIANTS = ("sdpo_gate", "sdpo_agree", "hybrid_frozen")
GATE_ALPHA, ALPHA, MARGIN = 0.05, 0.025, 0.05


@dataclass(frozen=True)
class Outcome:
    arm: str
    n: int
    mean: float  # D_V
    p_holm: float
    positive: int
    needed: int
    primary: str  # "passed", "passed, below the effect that matters", "failed"
    gain_mean: float | None = None
    gain_p: float | None = None
    noninferior_lo: float | None = None
    co_primary: str | None = None  # None where the primary failed


def one_sided_p(summary: stats.PairedSummary) -> float:
    """p of the paired t-test of H₁ mean > 0 (1 with fewer than 2 seeds)."""
    if summary.sd is None:
        return 1.0
    if summary.sd == 0.0:
        return 0.0 if summary.mean > 0 else 1.0
    t = summary.mean / (summary.sd / math.sqrt(summary.n))
    return 1.0 - stats.t_cdf(t, summary.n - 1)


def endpoint(values: dict[str, float | None]) -> float | None:
    near, far = values.get(NEAR), values.get(FAR)
    return None if near is None or far is None else (near + far) / 2.0


def paired(runs: Sequence[tuple[str, int, dict]], arm: str, ref: str, metric) -> list[float]:
    """metric(arm) − metric(ref) over the seeds that have both (metric: values -> float)."""
    by_seed: dict[int, dict[str, dict]] = {}
    for a, seed, values in runs:
        by_seed.setdefault(seed, {})[a] = values
    out = []
    for seed in sorted(by_seed):
        row = by_seed[seed]
        if arm in row and ref in row:
            x, y = metric(row[arm]), metric(row[ref])
            if x is not None and y is not None:
                out.append(x - y)
    return out


def analyse(runs: Sequence[tuple[str, int, dict]]) -> dict:
    """The gate and each variant's verdicts from (arm, seed, metric values) of every run."""
    gap_diffs = paired(runs, BASELINE, REFERENCE, endpoint)  # E(GRPO) − E(SDPO₀)
    if len(gap_diffs) < 2:
        raise ValueError(f"the gate needs {BASELINE} and {REFERENCE} on at least 2 seeds, got {len(gap_diffs)}")
    gap = stats.paired_summary(gap_diffs)
    gate_p = one_sided_p(gap)  # SDPO₀ below GRPO <=> the gap above 0
    gate = {"n": gap.n, "gap": gap.mean, "p": gate_p, "passed": gap.mean > 0 and gate_p < GATE_ALPHA}
    present = [v for v in VARIANTS if paired(runs, v, REFERENCE, endpoint)]
    if not gate["passed"] or not present:
        return {"gate": gate, "outcomes": []}
    summaries = [stats.paired_summary(paired(runs, v, REFERENCE, endpoint)) for v in present]
    adjusted = holm_adjusted([one_sided_p(s) for s in summaries])
    outcomes = []
    for v, s, p in zip(present, summaries, adjusted, strict=True):
        needed = math.ceil(7 * s.n / 8)
        passed = p < ALPHA and s.positive >= needed
        primary = (
            ("passed" if s.mean >= gap.mean / 2 else "passed, below the effect that matters") if passed else "failed"
        )
        out = Outcome(v, s.n, s.mean, p, s.positive, needed, primary)
        if passed:
            gains = [g for a, _, vals in runs if a == v and (g := vals.get(GAIN)) is not None]
            g = stats.paired_summary(gains) if gains else None
            d = stats.paired_summary(paired(runs, v, REFERENCE, lambda vals: vals.get(GAIN)))
            g_p = one_sided_p(g) if g is not None else 1.0
            lo = d.lo if d.lo is not None else -math.inf  # the two-sided 95% lower bound
            co = "passed" if g_p < ALPHA and lo > -MARGIN else "failed"
            out = Outcome(
                v, s.n, s.mean, p, s.positive, needed, primary, g.mean if g is not None else None, g_p, lo, co
            )
        outcomes.append(out)
    return {"gate": gate, "outcomes": outcomes}


# The tuning rules (docs/studies.md, "Seeds"): the gate's s0 and the confirmatory seed count.
GATE_ARMS = {0.0: "sdpo_gate", 0.25: "gate25"}  # the tuning study's arm per s0
S0_TIE, DETECT, N_MIN, N_MAX = 0.01, 0.05, 8, 16
Z_975, Z_80 = 1.959963984540054, 0.8416212335729143  # standard normal quantiles


@dataclass(frozen=True)
class Tuning:
    s0: float
    gate_d: dict[float, float]  # mean D_V per s0 (V: the gate at that s0)
    gain_sd: float  # sd of the paired in-stage math gain difference SDPO₀ − GRPO
    n_asked: int  # the rule's seed count before the cap
    n: int  # the confirmatory seed count (N_MIN ≤ n ≤ N_MAX)


def tuning(runs: Sequence[tuple[str, int, dict]]) -> Tuning:
    """s0 and N from the tuning seeds' runs: s0 the value whose mean E(gate) − E(SDPO₀) is larger,
    0 (the parameter-free gate) unless 0.25's exceeds it by more than 0.01; N = max(8,
    ⌈((z₀.₉₇₅ + z₀.₈) · sd / 0.05)²⌉), at most 16 (n_asked says what the rule asked)."""
    gate_d = {}
    for s0, arm in GATE_ARMS.items():
        diffs = paired(runs, arm, REFERENCE, endpoint)
        if len(diffs) < 2:
            raise ValueError(f"the tuning needs {arm} and {REFERENCE} on at least 2 seeds, got {len(diffs)}")
        gate_d[s0] = sum(diffs) / len(diffs)
    s0 = 0.25 if gate_d[0.25] > gate_d[0.0] + S0_TIE else 0.0
    diffs = paired(runs, REFERENCE, BASELINE, lambda vals: vals.get(GAIN))
    if len(diffs) < 2:
        raise ValueError(f"the seed count needs {REFERENCE} and {BASELINE} on at least 2 seeds, got {len(diffs)}")
    sd = cast(float, stats.paired_summary(diffs).sd)
    asked = math.ceil(((Z_975 + Z_80) * sd / DETECT) ** 2)
    return Tuning(s0, gate_d, sd, asked, min(max(N_MIN, asked), N_MAX))


def cell(xs: Sequence[float | None], fmt: str = "{:+.3f}") -> str:
    """The mean of the values present, formatted ("–" when none is)."""
    m = _mean(list(xs))
    return "–" if m is None else fmt.format(m)


def tuning_table(runs: Sequence[tuple[str, int, dict]]) -> list[str]:
    """The tuning study as markdown lines (docs/findings.md's safeguard-tuning block): each arm's
    mean endpoints over the tuning seeds (described, never tested nor pooled) and the two rules'
    outcome."""
    t = tuning(runs)
    seeds = sorted({s for _, s, _ in runs})
    arms = list(dict.fromkeys(a for a, _, _ in runs))
    lines = [
        "| arm | seeds | E = (near + far) / 2 | near | far | in-stage math gain | E − E(SDPO₀) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        vals = [v for a, _, v in runs if a == arm]

        d = paired(runs, arm, REFERENCE, endpoint) if arm != REFERENCE else []
        lines.append(
            f"| `{arm}` | {len(vals)} | {cell([endpoint(v) for v in vals])} | "
            f"{cell([v.get(NEAR) for v in vals])} | {cell([v.get(FAR) for v in vals])} | "
            f"{cell([v.get(GAIN) for v in vals])} | {cell(d)} |"
        )
    gates = ", ".join(f"s₀ = {s0:g}: {d:+.3f}" for s0, d in t.gate_d.items())
    capped = (
        f" (the rule asked {t.n_asked}; the cap runs {t.n})" if t.n_asked > N_MAX else f" (the rule asked {t.n_asked})"
    )
    lines += [
        "",
        f"Tuning seeds {', '.join(map(str, seeds))}. The gate's mean E − E(SDPO₀): {gates}; "
        f"s₀ = {t.s0:g}. The sd of the paired in-stage math gain difference SDPO₀ − GRPO is {t.gain_sd:.4f}: "
        f"N = {t.n} confirmatory seeds{capped}.",
    ]
    return lines


def table(runs: Sequence[tuple[str, int, dict]]) -> list[str]:
    """The pre-registered verdicts as markdown lines (docs/findings.md's safeguard block)."""
    result = analyse(runs)
    g = result["gate"]
    lines = [
        f"Gate: E({BASELINE}) − E({REFERENCE}) = {g['gap']:+.3f} over {g['n']} seeds, one-sided p = {g['p']:.4f}: "
        + ("passed" if g["passed"] else "not passed; no safeguard is judged"),
        "",
    ]
    if not result["outcomes"]:
        return lines
    lines += [
        "| variant | D = E(variant) − E(SDPO₀) | Holm p | seeds D > 0 (needed) | primary | in-stage math gain, p | "
        "gain − SDPO₀'s, 95% lower bound | co-primary |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in result["outcomes"]:
        gain = "–" if o.gain_mean is None else f"{o.gain_mean:+.3f}, {o.gain_p:.4f}"
        lo = "–" if o.noninferior_lo is None else f"{o.noninferior_lo:+.3f}"
        lines.append(
            f"| `{o.arm}` | {o.mean:+.3f} | {o.p_holm:.4f} | {o.positive} of {o.n} ({o.needed}) | "
            f"*{o.primary}* | {gain} | {lo} | {o.co_primary or '–'} |"
        )
    return lines
