"""The paper's direction for each study metric: the sign of (SDPO - GRPO) the paper's own numbers
give, with those numbers and where they are stated (SDPO-CL, "Denser != Better", Qwen3-4B,
MATH -> SCIENCE -> TOOLUSE -> CODING; GRPO is its baseline).

A metric gets a direction only from a number the paper reports for it: `sdpo` and `grpo` are
the paper's two values and `relation` how the metric moves with them (+1: the metric is that
quantity or grows with it; -1: it shrinks with it, e.g. forgetting with the final accuracy), so
direction = relation * sign(sdpo - grpo). A metric the paper reports nothing for is descriptive.
A comparison against another baseline than GRPO has no paper direction at all.

Provenance: the paper's text (its abstract and its project page, read for this) states none of
these numbers. Each is either *transcribed* (a table's values as the project's method notes
transcribed them, not checked against the paper's PDF here) or *read off a plot* (a bar or curve
read by eye, to a stated resolution in the number's own unit). A plot reading whose two values
differ by less than twice its resolution gives no direction: the metric is descriptive.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER_BASELINE = "grpo"


@dataclass(frozen=True)
class PaperNumber:
    sdpo: float
    grpo: float
    relation: int  # +1 / -1: see the module docstring
    stated: str  # the numbers as the paper reports them
    source: str  # where in the paper
    provenance: str  # TRANSCRIBED or PLOT (module docstring); no number here is from the text
    resolution: float | None = None  # a plot reading's resolution, in the numbers' unit

    def __post_init__(self) -> None:
        if self.provenance not in (TRANSCRIBED, PLOT):
            raise ValueError(f"{self.stated}: provenance must be {TRANSCRIBED!r} or {PLOT!r}")
        if (self.provenance == PLOT) != (self.resolution is not None):
            raise ValueError(f"{self.stated}: a plot reading states its resolution, and only a plot reading")

    @property
    def resolved(self) -> bool:
        """Whether the two values differ by more than the reading can tell apart (2 × resolution)."""
        return self.resolution is None or abs(self.sdpo - self.grpo) >= 2 * self.resolution

    @property
    def direction(self) -> int | None:
        """relation × sign(sdpo − grpo); None for a plot reading that does not resolve the two."""
        diff = self.sdpo - self.grpo
        if diff == 0:
            raise ValueError(f"{self.stated}: equal values give no direction")
        return self.relation * (1 if diff > 0 else -1) if self.resolved else None

    @property
    def provenance_text(self) -> str:
        if self.resolution is None:
            return "transcribed (table)"
        return f"plot reading, ±{self.resolution:g}" + ("" if self.resolved else ": unresolved, descriptive")


_MATH_STAGE = "in-domain gain after the MATH stage over the base, SDPO ≈ +73% vs GRPO ≈ +38%"
_FINAL = "final accuracies after CODING: MATH 34.4 vs 57.3, TOOLUSE 9.9 vs 57.7 (SDPO vs GRPO)"
_RESULTS = "paper, continual results (forgetting table)"
_STAGES = "paper, per-stage in-domain gains relative to the base"
_DRIFT = "paper, drift analysis (Qwen3-4B, frozen teacher)"

TRANSCRIBED, PLOT = "transcribed", "plot"
# Resolutions of the plot readings, stated here: a bar of per-stage relative gain read to ±5
# points; the drift figures' spectral shift to ±1 GRPO-shift, the angle to ±0.5°, the response
# cosine to ±1 point (the spans quoted, 91–94% and 0–0.5°, are the readings' own ranges).
_GAIN_RES, _SHIFT_RES, _ANGLE_RES, _COS_RES = 5.0, 1.0, 0.5, 1.0

PAPER: dict[str, PaperNumber] = {
    "in_stage_gain/math": PaperNumber(73.0, 38.0, 1, _MATH_STAGE, _STAGES, PLOT, _GAIN_RES),
    "mid_stage_gain/math": PaperNumber(
        73.0, 38.0, 1, _MATH_STAGE + " (the faster specialization)", _STAGES, PLOT, _GAIN_RES
    ),
    "in_stage_gain/tooluse": PaperNumber(
        -25.0, 24.0, 1, "TOOLUSE stage, relative to the base: SDPO₀ ≈ −25% vs GRPO ≈ +24%", _STAGES, PLOT, _GAIN_RES
    ),
    # 17 vs 21 is 4 points apart, under two readings' resolution: no direction (descriptive).
    "in_stage_gain/code": PaperNumber(
        17.0, 21.0, 1, "CODING stage, relative to the base: SDPO₀ ≈ +17% vs GRPO ≈ +21%", _STAGES, PLOT, _GAIN_RES
    ),
    "backward_transfer": PaperNumber(
        34.4 + 9.9, 57.3 + 57.7, 1, _FINAL + "; GRPO improves earlier domains", _RESULTS, TRANSCRIBED
    ),
    "backward_transfer/math": PaperNumber(34.4, 57.3, 1, "final MATH 34.4 vs 57.3", _RESULTS, TRANSCRIBED),
    "backward_transfer/tooluse": PaperNumber(9.9, 57.7, 1, "final TOOLUSE 9.9 vs 57.7", _RESULTS, TRANSCRIBED),
    "forgetting": PaperNumber(34.4 + 9.9, 57.3 + 57.7, -1, _FINAL, _RESULTS, TRANSCRIBED),
    "final_avg_id": PaperNumber(34.4 + 9.9, 57.3 + 57.7, 1, _FINAL, _RESULTS, TRANSCRIBED),
    "final_id/math": PaperNumber(34.4, 57.3, 1, "final MATH 34.4 vs 57.3", _RESULTS, TRANSCRIBED),
    "final_id/tooluse": PaperNumber(9.9, 57.7, 1, "final TOOLUSE 9.9 vs 57.7", _RESULTS, TRANSCRIBED),
    "spectral_shift": PaperNumber(4.0, 1.0, 1, "spectral shift ≈ 4× GRPO's", _DRIFT, PLOT, _SHIFT_RES),
    "max_angle_deg": PaperNumber(2.5, 0.5, 1, "max principal angle ≈ 2.5° vs 0–0.5°", _DRIFT, PLOT, _ANGLE_RES),
    "response_cosine": PaperNumber(
        92.5, 96.5, 1, "response cosine to the base 91–94% vs 96–97%", _DRIFT, PLOT, _COS_RES
    ),
}

# One primary metric per finding (the one its verdict is read from; the others are secondary,
# Holm-adjusted). For the studies run before this table existed they were chosen after the data.
PRIMARY: dict[str, str] = {
    "specialization": "in_stage_gain/math",
    "forgetting": "backward_transfer",
    "final_average": "final_avg_id",
    "ood_distance": "ood_change/mid",
    "drift": "spectral_shift",
    "artifacts": "boxed_repeat_gain",
}


def direction(metric: str, baseline: str) -> int | None:
    """The paper's sign of (arm - baseline) for `metric`; None where the paper states no number or
    the baseline is not the paper's."""
    if baseline != PAPER_BASELINE:
        return None
    number = PAPER.get(metric)
    return None if number is None else number.direction


def direction_table() -> list[str]:
    """The directions as docs/studies.md shows them (a test holds the two equal)."""
    lines = [
        "| metric | paper (SDPO vs GRPO) | direction of SDPO − GRPO | source | provenance |",
        "|---|---|---|---|---|",
    ]
    for name, n in PAPER.items():
        sign = {1: "+", -1: "−", None: "none (descriptive)"}[n.direction]
        lines.append(f"| `{name}` | {n.stated} | {sign} | {n.source} | {n.provenance_text} |")
    return lines
