"""The safeguard study's pre-registered analysis on hand-built seeds: the gate, the Holm-adjusted
one-sided primary with its seed count and the effect that matters, the co-primary."""

import math

import pytest

from megatron_sdpo.study import preregistered as pr
from megatron_sdpo.study.stats import paired_summary


def test_one_sided_p_at_the_t_table():
    # t_{0.95, 7} = 1.8946: a mean of 1.8946 * sd / sqrt(8) gives p = 0.05.
    d = [0.1, 0.3] * 4
    s = paired_summary(d)
    shifted = [x - s.mean + 1.8946 * s.sd / math.sqrt(8) for x in d]
    assert pr.one_sided_p(paired_summary(shifted)) == pytest.approx(0.05, abs=2e-4)
    assert pr.one_sided_p(paired_summary([0.2] * 3)) == 0.0 and pr.one_sided_p(paired_summary([-0.2] * 3)) == 1.0


def _runs(variant_d: dict[str, list[float]], *, gap: float = 0.3, gains=None) -> list:
    """8 seeds: GRPO's endpoint 0.1, SDPO₀'s 0.1 - gap (± 0.01 by seed), each variant SDPO₀'s + d."""
    out = []
    for seed in range(8):
        sdpo = 0.1 - gap + (0.01 if seed % 2 else -0.01)
        out.append(("grpo", seed, {pr.NEAR: 0.1, pr.FAR: 0.1, pr.GAIN: 0.2}))
        out.append(("sdpo_frozen", seed, {pr.NEAR: sdpo, pr.FAR: sdpo, pr.GAIN: 0.12}))
        for v, d in variant_d.items():
            e = sdpo + d[seed]
            out.append((v, seed, {pr.NEAR: e - 0.05, pr.FAR: e + 0.05, pr.GAIN: (gains or {}).get(v, 0.1)}))
    return out


def test_the_primary_and_co_primary_by_hand():
    d = {
        "sdpo_gate": [0.1, 0.3] * 4,  # mean 0.2 >= gap / 2 = 0.15, every seed positive
        "sdpo_agree": [0.04, 0.06] * 4,  # mean 0.05: significant, below the effect that matters
        "hybrid_frozen": [0.2, -0.1] * 4,  # 4 of 8 positive
    }
    res = pr.analyse(_runs(d, gains={"sdpo_gate": 0.1, "sdpo_agree": 0.02}))
    assert res["gate"]["passed"] and res["gate"]["gap"] == pytest.approx(0.3)
    o = {x.arm: x for x in res["outcomes"]}
    assert o["sdpo_gate"].mean == pytest.approx(0.2) and o["sdpo_gate"].primary == "passed"
    assert o["sdpo_agree"].primary == "passed, below the effect that matters"
    assert (
        o["hybrid_frozen"].primary == "failed" and o["hybrid_frozen"].positive == 4 and o["hybrid_frozen"].needed == 7
    )
    assert o["hybrid_frozen"].co_primary is None
    # Holm over three: the smallest raw p times 3, the next times 2 (never below the previous).
    raw = {v: pr.one_sided_p(paired_summary(x)) for v, x in d.items()}
    order = sorted(raw, key=raw.get)
    assert o[order[0]].p_holm == pytest.approx(min(1.0, 3 * raw[order[0]]))
    assert o[order[1]].p_holm == pytest.approx(max(o[order[0]].p_holm, min(1.0, 2 * raw[order[1]])))
    # Co-primary: the gate's gain 0.1 > 0 on every seed, 0.1 - 0.12 = -0.02 > -0.05: non-inferior;
    # the mask's 0.02 - 0.12 = -0.10: inferior.
    assert o["sdpo_gate"].co_primary == "passed" and o["sdpo_gate"].noninferior_lo == pytest.approx(-0.02)
    assert o["sdpo_agree"].co_primary == "failed"
    lines = pr.table(_runs(d, gains={"sdpo_gate": 0.1, "sdpo_agree": 0.02}))
    assert lines[0].startswith("Gate: E(grpo) − E(sdpo_frozen) = +0.300 over 8 seeds") and lines[0].endswith("passed")
    assert len(lines) == 7 and lines[4].startswith("| `sdpo_gate` | +0.200 |") and lines[4].endswith("| passed |")


def test_no_gap_no_verdicts():
    res = pr.analyse(_runs({"sdpo_gate": [0.2] * 8}, gap=-0.05))
    assert not res["gate"]["passed"] and res["outcomes"] == []
    assert pr.table(_runs({"sdpo_gate": [0.2] * 8}, gap=-0.05))[0].endswith("not passed; no safeguard is judged")
    with pytest.raises(ValueError, match="at least 2 seeds"):
        pr.analyse([("grpo", 0, {pr.NEAR: 0, pr.FAR: 0})])


def _tuning_runs(d0: float, d25: float, gain_diffs: list[float]) -> list:
    """4 tuning seeds: SDPO₀'s endpoint 0 (GRPO's 0.2), the gate at s0 = 0 / 0.25 d0 / d25 above it;
    GRPO's math gain 0.2, SDPO₀'s 0.2 + gain_diffs[seed]."""
    out = []
    for seed, g in enumerate(gain_diffs):
        out.append(("grpo", seed, {pr.NEAR: 0.2, pr.FAR: 0.2, pr.GAIN: 0.2}))
        out.append(("sdpo_frozen", seed, {pr.NEAR: 0.0, pr.FAR: 0.0, pr.GAIN: 0.2 + g}))
        out.append(("sdpo_gate", seed, {pr.NEAR: d0 - 0.04, pr.FAR: d0 + 0.04}))
        out.append(("gate25", seed, {pr.NEAR: d25, pr.FAR: d25}))
    return out


def test_the_tuning_rules_by_hand():
    # s0: 0.25 only where its gate beats the parameter-free one by more than 0.01.
    assert pr.tuning(_tuning_runs(0.05, 0.07, [0.0, 0.1] * 2)).s0 == 0.25
    assert pr.tuning(_tuning_runs(0.05, 0.055, [0.0, 0.1] * 2)).s0 == 0.0  # a tie within 0.01
    assert pr.tuning(_tuning_runs(0.05, -0.1, [0.0, 0.1] * 2)).s0 == 0.0
    t = pr.tuning(_tuning_runs(0.05, 0.07, [0.0, 0.1] * 2))
    assert t.gate_d == pytest.approx({0.0: 0.05, 0.25: 0.07})
    # Gain differences 0, 0.1, 0, 0.1: sd = sqrt(4 * 0.05^2 / 3) = 0.057735; (2.801585 * 0.057735
    # / 0.05)^2 = 10.465: 11 seeds.
    assert t.gain_sd == pytest.approx(0.0577350, rel=1e-6) and (t.n_asked, t.n) == (11, 11)
    # sd 0.11547: the rule asks 42, the cap runs 16; no spread: the floor of 8.
    t = pr.tuning(_tuning_runs(0.05, 0.07, [0.0, 0.2] * 2))
    assert (t.n_asked, t.n) == (42, 16)
    assert pr.tuning(_tuning_runs(0.05, 0.07, [0.1] * 4)).n == 8
    with pytest.raises(ValueError, match="on at least 2 seeds"):
        pr.tuning([r for r in _tuning_runs(0.05, 0.07, [0.0, 0.1]) if r[0] != "gate25"])


def test_the_tuning_table_reports_each_arm_and_the_rules():
    lines = pr.tuning_table(_tuning_runs(0.05, 0.07, [0.0, 0.1] * 2))
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| `")}
    # SDPO₀: E 0, gains 0.2, 0.3, 0.2, 0.3; the gate at s0 = 0: near d0 - 0.04, far d0 + 0.04.
    assert rows["| `sdpo_frozen`"] == "| `sdpo_frozen` | 4 | +0.000 | +0.000 | +0.000 | +0.250 | – |"
    assert rows["| `sdpo_gate`"] == "| `sdpo_gate` | 4 | +0.050 | +0.010 | +0.090 | – | +0.050 |"
    assert rows["| `grpo`"].endswith("| +0.200 | +0.200 |")
    assert lines[-1] == (
        "Tuning seeds 0, 1, 2, 3. The gate's mean E − E(SDPO₀): s₀ = 0: +0.050, s₀ = 0.25: +0.070; "
        "s₀ = 0.25. The sd of the paired in-stage math gain difference SDPO₀ − GRPO is 0.0577: "
        "N = 11 confirmatory seeds (the rule asked 11)."
    )
    assert pr.tuning_table(_tuning_runs(0.05, 0.07, [0.0, 0.2] * 2))[-1].endswith(
        "N = 16 confirmatory seeds (the rule asked 42; the cap runs 16)."
    )
