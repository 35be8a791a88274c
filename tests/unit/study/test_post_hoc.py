"""The safeguard study's post-hoc readings on hand-built seeds: the specialization verdict, the
hybrid against the dilution midpoint, the failed variants' upper bounds against the effect that
matters, the sd the seed count was sized from, and the collapse signature's columns."""

from megatron_sdpo.study import post_hoc as ph
from megatron_sdpo.study import preregistered as pr


def _runs(hybrid_offset: list[float], gate_d: list[float], gain_gap: list[float]) -> list:
    """8 seeds: E(GRPO) 0.1, E(SDPO₀) −0.5 (the gap 0.6, the effect that matters 0.3); the hybrid
    at the midpoint −0.2 plus its offset; the gate SDPO₀'s E plus its D; SDPO₀'s gain GRPO's
    (0.3) plus gain_gap."""
    out = []
    for s in range(8):
        out.append(("grpo", s, {pr.NEAR: 0.1, pr.FAR: 0.1, pr.GAIN: 0.3, "reward_change": 0.2}))
        out.append(
            (
                "sdpo_frozen",
                s,
                {
                    pr.NEAR: -0.5,
                    pr.FAR: -0.5,
                    pr.GAIN: 0.3 + gain_gap[s],
                    "reward_change": -0.1 if s < 6 else 0.05,
                    "boxed_repeat_max": 0.0625,
                    "boxed_repeat_gain": 0.03125,
                    "teacher_artifact_endorsement": 0.1 + 0.01 * s,
                },
            )
        )
        e = -0.2 + hybrid_offset[s]
        out.append(("hybrid_frozen", s, {pr.NEAR: e, pr.FAR: e, pr.GAIN: 0.3}))
        out.append(("sdpo_gate", s, {pr.NEAR: -0.5 + gate_d[s], pr.FAR: -0.5 + gate_d[s], pr.GAIN: 0.3}))
    return out


def test_the_readings_by_hand():
    runs = _runs([0.05, -0.05] * 4, [0.02, -0.02] * 4, [-0.1, -0.12] * 4)
    rows = ph.table(runs, runs)
    assert rows[0].startswith("| reading (post hoc) |") and len(rows) == 2 + 3 + 2
    # SDPO₀ − GRPO gain −0.11, every seed against the paper's (+) direction.
    assert (
        "| -0.110 [" in rows[2] and "| 0 of 8 in the paper's direction | *contradicted* by the study rule |" in rows[2]
    )
    # The hybrid sits on the midpoint on average: not resolved from it.
    assert "| +0.000 [" in rows[3] and "not resolved from the midpoint" in rows[3]
    # The gate's D ±0.02 around 0: the upper bound is far below 0.3, the effect that matters.
    assert "(0.300)" in rows[4] and "upper bound below 0.300: rules out the effect that matters" in rows[4]
    # sd of the gain difference SDPO₀ − GRPO: ±0.01 around −0.11.
    assert "sd 0.011" in rows[5] and "the rule asks 1 seeds" in rows[5]


def test_a_hybrid_above_the_midpoint_and_a_gate_that_does_not_rule_out():
    runs = _runs([0.1, 0.12] * 4, [0.0, 0.6] * 4, [-0.1, -0.12] * 4)
    rows = ph.table(runs, runs)
    assert rows[3].endswith("| 8 of 8 above | above the midpoint |")
    assert rows[4].endswith("| does not rule out the effect that matters |")


def test_the_collapse_signature_by_hand():
    runs = _runs([0.0] * 8, [0.0] * 8, [0.0] * 8)
    rows = {r.split(" |")[0]: r for r in ph.collapse_table(runs)}
    grpo, sdpo = rows["| `grpo`"], rows["| `sdpo_frozen`"]
    assert "| +0.200 [+0.200, +0.200] | 0 of 8 |" in grpo and grpo.endswith("| – (0) |")
    # 6 seeds at −0.1, 2 at +0.05: mean −0.0625, 6 of 8 fell; the endorsement 0.1 .. 0.17, mean 0.135.
    assert "| -0.062 [" in sdpo and "| 6 of 8 | 0.062 | +0.031 | +0.135 [" in sdpo and sdpo.endswith("(8) |")
    assert ph.collapse_table(runs)[0].count("|") == ph.collapse_table(runs)[1].count("|")
