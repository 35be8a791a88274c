"""OOD distance by data: how far each eval set lies from each stage's training set, and the OOD
change grouped by that distance.

The paper ("Denser != Better") orders its OOD sets by the RBF-MMD between sentence embeddings
of the datasets' prompts, not by hand; so does this module. One kernel bandwidth serves every
pair of a table (the median pairwise distance over all datasets pooled): a per-pair median
heuristic would measure each pair in its own unit and the distances would not sort.

    distance_table(train_prompts, eval_prompts, embedder)  -> run_dir/ood_distance.json
    ood_change_by_distance(eval_matrix, table)             -> near / mid / far groups

Near / mid / far: the (stage, OOD eval set) pairs sorted by distance and cut into three groups
of equal size (the first groups take one more when the count does not divide): terciles of the
run's own distances, not fixed thresholds, so every group is populated whatever the domains.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_sdpo.diagnostics.forgetting import EvalMatrix
from megatron_sdpo.diagnostics.response_drift import Embedder, median_bandwidth, mmd_rbf
from megatron_sdpo.errors import DataError

OOD_DISTANCE_FILE = "ood_distance.json"
GROUPS = ("near", "mid", "far")


def dataset_distance(emb_a: torch.Tensor, emb_b: torch.Tensor, *, bandwidth: float) -> float:
    """RBF-MMD (the square root of the biased MMD^2, >= 0, 0 for identical sets) between two
    datasets' embeddings [N, D] and [M, D] with kernel exp(-|u-v|^2 / (2 bandwidth^2))."""
    return float(mmd_rbf(emb_a, emb_b, bandwidth=bandwidth)["mmd"])


def _sample(texts: Sequence[str], n: int, seed: int) -> list[str]:
    """At most n texts, a seeded sample in their original order (all of them when n <= 0)."""
    if n <= 0 or len(texts) <= n:
        return list(texts)
    keep = sorted(random.Random(seed).sample(range(len(texts)), n))
    return [texts[i] for i in keep]


def distance_table(
    train_prompts: Mapping[str, Sequence[str]],
    eval_prompts: Mapping[str, Sequence[str]],
    embedder: Embedder,
    *,
    n: int = 128,
    seed: int = 0,
) -> dict:
    """RBF-MMD between each training set's prompts and each eval set's prompts.

    train_prompts: {stage domain: prompts}; eval_prompts: {"<domain>/<split>": prompts}; at most
    `n` prompts of each (a seeded sample) are embedded. Returns {"bandwidth", "n",
    "distances": {domain: {eval set: mmd}}}. DataError when a set has no prompts."""
    names = [("train", k) for k in train_prompts] + [("eval", k) for k in eval_prompts]
    if not train_prompts or not eval_prompts:
        raise DataError("the OOD distance table needs at least one training set and one eval set")
    texts: dict[tuple[str, str], list[str]] = {}
    for kind, key in names:
        src = train_prompts[key] if kind == "train" else eval_prompts[key]
        if not src:
            raise DataError(f"the OOD distance table got no prompts for {kind} set {key!r}")
        texts[(kind, key)] = _sample(src, n, seed)
    flat = [t for name in names for t in texts[name]]
    emb_all = embedder.encode(flat).to(torch.float64)
    emb: dict[tuple[str, str], torch.Tensor] = {}
    at = 0
    for name in names:
        emb[name] = emb_all[at : at + len(texts[name])]
        at += len(texts[name])
    # One bandwidth for the whole table, from a bounded sample of the pooled points (cdist is N^2).
    pooled = torch.cat([e[: max(1, 512 // len(names))] for e in emb.values()])
    bandwidth = float(median_bandwidth(pooled))
    distances = {
        d: {s: dataset_distance(emb[("train", d)], emb[("eval", s)], bandwidth=bandwidth) for s in eval_prompts}
        for d in train_prompts
    }
    return {"bandwidth": bandwidth, "n": n, "seed": seed, "distances": distances}


def _ols_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of y on x; None with fewer than two distinct x."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def ood_change_by_distance(matrix: EvalMatrix, table: Mapping, *, id_split: str = "id") -> dict:
    """OOD accuracy change per (stage, OOD eval set) pair against the distance from the stage's
    training set, grouped near / mid / far by terciles of distance (module docstring).

    A pair is every stage row k (domain d) and every column c whose split is not `id_split`
    (the in-domain sets measure learning and forgetting, not OOD transfer) with a distance
    table[distances][d][c]. Its changes: in_stage = a_{k,c} - a_{k-1,c} (what stage k did to c)
    and from_base = a_{k,c} - a_{base,c}; pairs with a missing cell are left out. Returns
    {"pairs": [...sorted by distance], "groups": {near|mid|far: {"n", "distance_mean",
    "in_stage_mean", "from_base_mean", "pairs"}}, "slope_in_stage", "slope_from_base"} (slopes:
    least squares of change on distance over every pair; None with fewer than two distances).
    """
    distances = table.get("distances", {}) if isinstance(table, Mapping) else {}
    pairs: list[dict[str, Any]] = []
    for k, row in enumerate(matrix.rows[1:], start=1):
        row_dist = distances.get(row, {})
        for col in matrix.columns:
            if col.split("/", 1)[1] == id_split or col not in row_dist:
                continue
            now, before, base = matrix.get(row, col), matrix.get(matrix.rows[k - 1], col), matrix.get("base", col)
            dist = row_dist[col]
            if now is None or before is None or base is None or dist is None or not math.isfinite(dist):
                continue
            pairs.append(
                {
                    "stage": k,
                    "domain": row,
                    "column": col,
                    "distance": float(dist),
                    "in_stage": now - before,
                    "from_base": now - base,
                }
            )
    pairs.sort(key=lambda p: (p["distance"], p["stage"], p["column"]))
    groups = {}
    size, extra = divmod(len(pairs), len(GROUPS))
    at = 0
    for i, name in enumerate(GROUPS):
        part = pairs[at : at + size + (1 if i < extra else 0)]
        at += len(part)
        groups[name] = {
            "n": len(part),
            "distance_mean": _mean([p["distance"] for p in part]),
            "in_stage_mean": _mean([p["in_stage"] for p in part]),
            "from_base_mean": _mean([p["from_base"] for p in part]),
            "pairs": [f"{p['stage']}:{p['column']}" for p in part],
        }
    xs = [p["distance"] for p in pairs]
    return {
        "pairs": pairs,
        "groups": groups,
        "slope_in_stage": _ols_slope(xs, [p["in_stage"] for p in pairs]),
        "slope_from_base": _ols_slope(xs, [p["from_base"] for p in pairs]),
    }


def write_distance_table(
    run_root: Path,
    train_prompts: Mapping[str, Sequence[str]],
    eval_prompts: Mapping[str, Sequence[str]],
    embedder: Embedder,
    *,
    n: int,
    seed: int,
) -> Path:
    """run_root/ood_distance.json from `distance_table`, written atomically; an existing table
    is kept (it depends on the data only, and a resumed run must not recompute it)."""
    path = Path(run_root) / OOD_DISTANCE_FILE
    if path.is_file():
        return path
    table = distance_table(train_prompts, eval_prompts, embedder, n=n, seed=seed)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)
    return path


def read_distance_table(run_root: Path) -> dict | None:
    """The run's ood_distance.json, or None when it has none; DataError when it is unreadable."""
    path = Path(run_root) / OOD_DISTANCE_FILE
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read the OOD distance table ({exc})") from None
    if not isinstance(table, dict) or not isinstance(table.get("distances"), dict):
        raise DataError(f"{path}: not an OOD distance table (no 'distances' mapping)")
    return table
