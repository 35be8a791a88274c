"""The safeguard study's secondary endpoints (docs/studies.md, "Secondary"): described, never
judged. Per arm, over the seeds: the primary endpoint E and the in-stage math gain against GRPO
(paired, with 95% t-intervals), the share of near answers using the item's operation, drift,
the teacher–student KL on all-success groups, the safeguards' own rates and the compute.

Everything is read from an exported run: its metrics values (study/metrics.py), its pruned
metrics.jsonl (the per-step keys listed in `STEP_KEYS`, kept by the export) and operations.json
(the export's right-operation shares, study/operations.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from megatron_sdpo.study import stats
from megatron_sdpo.study.preregistered import BASELINE, GAIN, cell, endpoint, paired

OPERATIONS_JSON = "operations.json"
# The per-step keys these endpoints read (the export keeps them in metrics.jsonl).
KL, GATE, AGREE = "teacher/kl_all_success", "sdpo/gate_mean", "sdpo/agree_frac"
COMPUTE = ("time/rollout", "time/teacher", "time/train")
STEP_KEYS = (KL, GATE, AGREE, *COMPUTE)


def step_values(rows: Sequence[dict], root: Path) -> dict[str, float | None]:
    """One run's secondary values from its per-step rows and its folder: the step means of the
    KL on all-success groups (measured on the teacher-signal steps only), the gate's mean weight
    and the agreeing share (None where the run never reports them), the summed rollout + teacher
    + train seconds, and the final eval row's right-operation share on the near split."""

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return math.fsum(vals) / len(vals) if vals else None

    compute = [float(r[k]) for r in rows for k in COMPUTE if isinstance(r.get(k), (int, float))]
    out: dict[str, float | None] = {
        KL: mean(KL),
        GATE: mean(GATE),
        AGREE: mean(AGREE),
        "compute_s": math.fsum(compute) if compute else None,
        "right_op/near": None,
    }
    path = root / OPERATIONS_JSON
    if path.is_file():
        near = [r for r in json.loads(path.read_text())["rows"] if r["split"] == "ood_near"]
        if near:
            out["right_op/near"] = max(near, key=lambda r: r["row"])["right"]
    return out


def _vs_baseline(runs: Sequence[tuple[str, int, dict]], arm: str, metric) -> str:
    if arm == BASELINE:
        return "–"
    d = paired(runs, arm, BASELINE, metric)
    if not d:
        return "–"
    s = stats.paired_summary(d)
    return f"{s.mean:+.3f}" + ("" if s.lo is None else f" [{s.lo:+.3f}, {s.hi:+.3f}]")


def table(runs: Sequence[tuple[str, int, dict]]) -> list[str]:
    """docs/findings.md's safeguard-secondary block from (arm, seed, values) of every run, values
    holding the study's metrics and `step_values`."""
    arms = list(dict.fromkeys(a for a, _, _ in runs))
    lines = [
        f"| arm | seeds | E − E({BASELINE}), 95% | in-stage math gain − {BASELINE}'s, 95% | near answers with "
        "the item's operation | spectral shift | max angle (°) | KL on all-success groups | gate weight | "
        "agreeing tokens | rollout + teacher + train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        vals = [v for a, _, v in runs if a == arm]

        def col(key: str, vals: list[dict] = vals) -> list[float | None]:
            return [v.get(key) for v in vals]

        lines.append(
            f"| `{arm}` | {len(vals)} | {_vs_baseline(runs, arm, endpoint)} | "
            f"{_vs_baseline(runs, arm, lambda v: v.get(GAIN))} | {cell(col('right_op/near'), '{:.3f}')} | "
            f"{cell(col('spectral_shift'), '{:.3g}')} | {cell(col('max_angle_deg'), '{:.2f}')} | "
            f"{cell(col(KL), '{:.4f}')} | {cell(col(GATE), '{:.3f}')} | {cell(col(AGREE), '{:.3f}')} | "
            f"{cell(col('compute_s'), '{:.0f}')} |"
        )
    return lines
