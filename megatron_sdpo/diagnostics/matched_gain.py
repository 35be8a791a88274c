"""KL to the base at matched gain: does one method move further from the base than another for
the same in-domain improvement (the paper's SDPO-vs-GRPO comparison at matched reward)?

A run's curve is its checkpoints as points (gain, kl): in-domain accuracy gain over the base and
KL(policy || base) on the policy's own answers, in training order. Between checkpoints both are
taken as linear in training progress, so the curve is the polyline through its points, and the
KL at gain level g is read where that polyline *first* reaches g (gain curves need not be
monotone: a later dip back through g would otherwise give a second answer). The common level of
two or more runs is, unless given, the smallest of their final gains: every run reached it.

A curve should start at the base, (0, 0); `gain_kl_curve` builds one from an eval matrix and
the runs' stage drift records.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from megatron_sdpo.diagnostics.forgetting import EvalMatrix

Curve = Sequence[tuple[float, float]]


def kl_at_gain(curve: Curve, level: float) -> float | None:
    """KL where the polyline through `curve`'s (gain, kl) points first reaches gain `level`;
    None when it never does (or the curve is empty). A point exactly at `level` returns its KL;
    between points p0 (gain below level) and p1 (at or above): kl0 + (level - g0) / (g1 - g0) *
    (kl1 - kl0)."""
    pts = [(float(g), float(k)) for g, k in curve]
    if not pts:
        return None
    if pts[0][0] >= level:
        return pts[0][1] if pts[0][0] == level else None
    for (g0, k0), (g1, k1) in zip(pts, pts[1:], strict=False):
        if g1 >= level > g0:
            return k0 + (level - g0) / (g1 - g0) * (k1 - k0)
    return None


def matched_gain_kl(curves: Mapping[str, Curve], level: float | None = None) -> dict:
    """KL of each run at one common gain level.

    level: the gain to compare at; by default the smallest final gain among the runs. Returns
    {"level", "kl": {run: kl or None}}; level None (and every kl None) when no positive common
    gain exists (a run that did not improve has no "KL for the same improvement")."""
    finals = [c[-1][0] for c in curves.values() if len(c)]
    if level is None:
        level = min(finals) if finals and len(finals) == len(curves) else None
        if level is not None and not level > 0.0:
            level = None
    if level is None or not math.isfinite(level):
        return {"level": None, "kl": {name: None for name in curves}}
    return {"level": level, "kl": {name: kl_at_gain(c, level) for name, c in curves.items()}}


def gain_kl_curve(
    matrix: EvalMatrix, drift: Sequence[Mapping], domain: str, *, id_split: str = "id"
) -> list[tuple[float, float]]:
    """(gain, kl) points of one run for `domain`: (0, 0) for the base, then every stage row that
    trained `domain` with its drift record's excess KL (k3) on "<domain>/<id_split>": gain =
    a_{row} - a_{base} on that column. Stages without both numbers are skipped."""
    col = f"{domain}/{id_split}"
    base = matrix.get("base", col) if col in matrix.columns else None
    if base is None:
        return []
    by_stage = {int(d["stage"]): d for d in drift if "stage" in d}
    points = [(0.0, 0.0)]
    for k, row in enumerate(matrix.rows[1:], start=1):
        acc = matrix.get(row, col)
        kl = by_stage.get(k, {}).get("excess_kl", {}).get(col, {}).get("kl_k3")
        if row != domain or acc is None or kl is None or not math.isfinite(kl):
            continue
        points.append((acc - base, float(kl)))
    return points
