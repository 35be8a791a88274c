"""Parameter drift between checkpoints, streamed one weight matrix at a time.

Per 2-D weight matrix A -> B:
  rel_frob        ||B - A||_F / ||A||_F
  spectral_shift  ||s_B - s_A||_2 / ||s_A||_2 over the top-`spectrum_k` singular values
  angle_*_deg     principal angles between the top-`rank` left (U) and right (V) singular
                  subspaces of A and B: mean and max, degrees
1-D tensors (norms, biases) get rel_change only and are reported apart from the matrices.
Between two *updates* (A0 -> A1) and (B0 -> B1): Jaccard overlap of their top-p% |dW| entries.

Memory: one tensor per source at a time, cast to fp32, plus the difference and an SVD
workspace of O((m + n) * (k + p)) for the randomized path: a small multiple of the largest
matrix, never the whole model.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_sdpo.diagnostics.sources import AlignedTensors, SourceLike, StreamSource, TensorSource, open_source
from megatron_sdpo.diagnostics.spectral import principal_angles, top_singular
from megatron_sdpo.errors import CheckpointError

# Name fragment -> layer type. HF (Llama/Qwen/Olmo) names first, then megatron-core names so
# a Megatron backend feeding native names is classified too.
_TYPE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"q_proj", "q_proj"),
    (r"k_proj", "k_proj"),
    (r"v_proj", "v_proj"),
    (r"o_proj|self_attention\.linear_proj", "o_proj"),
    (r"gate_proj", "gate_proj"),
    (r"up_proj", "up_proj"),
    (r"down_proj|mlp\.linear_fc2", "down_proj"),
    (r"linear_qkv", "qkv_proj"),
    (r"mlp\.linear_fc1", "gate_up_proj"),
    (r"embed_tokens|word_embeddings|wte", "embed"),
    (r"lm_head|output_layer", "lm_head"),
    (r"(?:^|\.)ln_", "norm"),
)
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")

MATRIX_METRICS = (
    "rel_frob",
    "spectral_shift",
    "angle_left_mean_deg",
    "angle_left_max_deg",
    "angle_right_mean_deg",
    "angle_right_max_deg",
    "angle_mean_deg",
    "angle_max_deg",
)


def layer_type(name: str) -> str:
    """Layer type of a parameter name: q_proj, k_proj, ..., embed, lm_head, norm, or other."""
    if any("norm" in part for part in name.split(".")):
        return "norm"  # before the projections: megatron fuses norms into linear_qkv.layer_norm_weight
    for pattern, kind in _TYPE_PATTERNS:
        if re.search(pattern, name):
            return kind
    return "other"


def layer_index(name: str) -> int | None:
    """Transformer block index in a parameter name (``model.layers.7.…`` -> 7), else None."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def _ratio(num: float, den: float) -> float:
    if den > 0.0:
        return num / den
    return 0.0 if num == 0.0 else math.inf


def matrix_drift(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    rank: int = 8,
    spectrum_k: int | None = 64,
    exact_max_dim: int = 512,
    seed: int = 0,
) -> dict:
    """Drift metrics of one weight matrix a [m, n] -> b [m, n] (any float dtype; fp32 inside).

    Returns a dict with the MATRIX_METRICS keys plus ``norm_a`` and ``norm_diff`` (Frobenius,
    for pooled aggregation), ``rank`` and ``spectrum_k`` actually used and ``svd`` ("exact" or
    "randomized"). The same seed is used for both matrices so identical inputs give identical
    factors and exactly-zero drift up to round-off.
    """
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"matrix_drift needs two equal 2-D shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    a = a.to(torch.float32)
    b = b.to(torch.float32)
    norm_a = torch.linalg.matrix_norm(a).item()
    norm_diff = torch.linalg.matrix_norm(b - a).item()
    r = min(rank, *a.shape)
    k = None if spectrum_k is None else max(spectrum_k, r)
    ua, sa, va, method = top_singular(a, k, exact_max_dim=exact_max_dim, seed=seed)
    ub, sb, vb, _ = top_singular(b, k, exact_max_dim=exact_max_dim, seed=seed)
    ks = sa.numel() if spectrum_k is None else min(spectrum_k, sa.numel())
    shift = _ratio(torch.linalg.vector_norm(sb[:ks] - sa[:ks]).item(), torch.linalg.vector_norm(sa[:ks]).item())
    left = principal_angles(ua[:, :r], ub[:, :r])
    right = principal_angles(va[:, :r], vb[:, :r])
    out = {
        "rel_frob": _ratio(norm_diff, norm_a),
        "spectral_shift": shift,
        "angle_left_mean_deg": left.mean().item(),
        "angle_left_max_deg": left.max().item(),
        "angle_right_mean_deg": right.mean().item(),
        "angle_right_max_deg": right.max().item(),
        "norm_a": norm_a,
        "norm_diff": norm_diff,
        "rank": r,
        "spectrum_k": ks,
        "svd": method,
    }
    out["angle_mean_deg"] = 0.5 * (out["angle_left_mean_deg"] + out["angle_right_mean_deg"])
    out["angle_max_deg"] = max(out["angle_left_max_deg"], out["angle_right_max_deg"])
    return out


def _aggregate(records: list[dict], metrics: Sequence[str]) -> dict:
    """Mean of each metric over `records` plus the pooled relative change
    sqrt(sum ||dW||^2) / sqrt(sum ||W||^2) (large matrices weigh more)."""
    out: dict = {"n": len(records)}
    for m in metrics:
        vals = [r[m] for r in records if m in r and math.isfinite(r[m])]
        out[f"mean_{m}"] = sum(vals) / len(vals) if vals else math.nan
    sq_a = sum(r["norm_a"] ** 2 for r in records)
    sq_d = sum(r["norm_diff"] ** 2 for r in records)
    out["rel_frob_pooled"] = _ratio(math.sqrt(sq_d), math.sqrt(sq_a))
    return out


def _grouped(records: list[dict]) -> tuple[dict[str, list[dict]], dict[int, list[dict]]]:
    """Per-tensor records by layer type and by layer index (a record of no layer: by type only)."""
    by_type: dict[str, list[dict]] = defaultdict(list)
    by_layer: dict[int, list[dict]] = defaultdict(list)
    for rec in records:
        by_type[rec["type"]].append(rec)
        if rec["layer"] is not None:
            by_layer[rec["layer"]].append(rec)
    return by_type, by_layer


def aggregate_drift(matrices: list[dict], vectors: list[dict]) -> dict:
    """Group per-tensor records by layer type and by layer index.

    Returns {"by_type": {type: stats}, "by_layer": {index: {type: stats, "all": stats}},
    "vectors_by_type": {type: stats}, "summary": stats over all matrices}.
    """
    by_type, by_layer = _grouped(matrices)
    vec_type, _ = _grouped(vectors)
    layers = {}
    for idx in sorted(by_layer):
        recs = by_layer[idx]
        entry = {"all": _aggregate(recs, MATRIX_METRICS)}
        groups: dict[str, list[dict]] = defaultdict(list)
        for rec in recs:
            groups[rec["type"]].append(rec)
        for kind, group in sorted(groups.items()):
            entry[kind] = _aggregate(group, MATRIX_METRICS)
        layers[str(idx)] = entry
    return {
        "summary": _aggregate(matrices, MATRIX_METRICS) if matrices else {"n": 0},
        "by_type": {k: _aggregate(v, MATRIX_METRICS) for k, v in sorted(by_type.items())},
        "by_layer": layers,
        "vectors_by_type": {k: _aggregate(v, ("rel_frob",)) for k, v in sorted(vec_type.items())},
    }


def parameter_drift(
    a: SourceLike,
    b: SourceLike,
    *,
    rank: int = 8,
    spectrum_k: int | None = 64,
    exact_max_dim: int = 512,
    include: Callable[[str], bool] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Stream two tensor sources and compute drift per tensor, then aggregate.

    a, b: checkpoint dirs / files, state dicts, or (name, tensor) streams (see sources.py).
    rank: r of the top-r singular subspaces compared by principal angles.
    spectrum_k: number of leading singular values in the spectral shift (None: full spectrum,
        forces exact SVD -- slow on 7B matrices).
    exact_max_dim: matrices with min(m, n) at most this use exact SVD; larger use randomized.
    include: optional name filter. Returns a JSON-serializable dict (see aggregate_drift) with
    "matrices" and "vectors" per-tensor records and "missing" names per source.
    """
    src_a, src_b = open_source(a), open_source(b)
    aligned = AlignedTensors([src_a, src_b], labels=["a", "b"])
    matrices: list[dict] = []
    vectors: list[dict] = []
    for name, (ta, tb) in aligned:
        if include is not None and not include(name):
            continue
        if not (ta.is_floating_point() and tb.is_floating_point()):
            continue
        if ta.shape != tb.shape:
            raise CheckpointError(
                f"{name}: shape {tuple(ta.shape)} in {src_a.label} but {tuple(tb.shape)} in {src_b.label}"
            )
        base: dict[str, Any] = {
            "name": name,
            "type": layer_type(name),
            "layer": layer_index(name),
            "shape": list(ta.shape),
        }
        if ta.dim() == 2 and base["type"] != "norm":
            if progress is not None:
                progress(name)
            base.update(matrix_drift(ta, tb, rank=rank, spectrum_k=spectrum_k, exact_max_dim=exact_max_dim, seed=seed))
            matrices.append(base)
        else:
            fa, fb = ta.to(torch.float32), tb.to(torch.float32)
            norm_a = torch.linalg.vector_norm(fa).item()
            norm_diff = torch.linalg.vector_norm(fb - fa).item()
            base.update({"rel_frob": _ratio(norm_diff, norm_a), "norm_a": norm_a, "norm_diff": norm_diff})
            vectors.append(base)
        del ta, tb
    if not matrices and not vectors:
        raise CheckpointError(f"no tensors in common between {src_a.label} and {src_b.label}")
    result = {
        "a": src_a.label,
        "b": src_b.label,
        "config": {"rank": rank, "spectrum_k": spectrum_k, "exact_max_dim": exact_max_dim, "seed": seed},
        "matrices": matrices,
        "vectors": vectors,
        "missing": {"a": aligned.missing["a"], "b": aligned.missing["b"]},
    }
    result.update(aggregate_drift(matrices, vectors))
    return result


def _top_mask(delta: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask [numel] of the k largest |delta| entries, excluding exact zeros (an untouched
    weight is not part of an update even when fewer than k entries moved)."""
    flat = delta.reshape(-1).abs()
    idx = torch.topk(flat, k, sorted=False).indices
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[idx] = True
    return mask & (flat > 0)


def mask_overlap_tensors(
    a0: torch.Tensor, a1: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor, *, top_percent: float = 1.0
) -> dict:
    """Jaccard overlap of the top-`top_percent`% |dW| entries of updates a0->a1 and b0->b1.

    All four tensors share one shape. k = max(1, round(numel * top_percent / 100)); ties at
    the threshold are broken by torch.topk. Returns {"jaccard", "intersection", "union", "k",
    "chance"}: chance = p / (2 - p) is the expected Jaccard of two independent random masks
    of density p. "jaccard" is NaN when neither update changed any entry.
    """
    if not 0.0 < top_percent <= 100.0:
        raise ValueError(f"top_percent must be in (0, 100], got {top_percent}")
    numel = a0.numel()
    k = max(1, min(numel, round(numel * top_percent / 100.0)))
    ma = _top_mask(a1.to(torch.float32) - a0.to(torch.float32), k)
    mb = _top_mask(b1.to(torch.float32) - b0.to(torch.float32), k)
    inter = int((ma & mb).sum())
    union = int((ma | mb).sum())
    p = k / numel
    return {
        "jaccard": inter / union if union else math.nan,
        "intersection": inter,
        "union": union,
        "k": k,
        "chance": p / (2.0 - p),
    }


def update_mask_overlap(
    update1: tuple[SourceLike, SourceLike],
    update2: tuple[SourceLike, SourceLike],
    *,
    top_percent: float = 1.0,
    include: Callable[[str], bool] | None = None,
) -> dict:
    """Mask overlap between two updates, e.g. (base, sdpo) vs (base, grpo), or
    (stage_k-1, stage_k) vs (stage_k, stage_k+1): three or four distinct checkpoints.

    Paths given twice are opened once. Per 2-D matrix Jaccard of top-p% |dW| masks, then the
    mean per layer type and overall, plus the pooled Jaccard (intersections and unions summed
    over matrices). Returns a JSON-serializable dict.
    """
    raw = [update1[0], update1[1], update2[0], update2[1]]
    opened: dict[object, TensorSource | StreamSource] = {}
    slots = []
    for s in raw:
        key = str(s) if isinstance(s, (str, bytes)) or hasattr(s, "__fspath__") else id(s)
        if key not in opened:
            opened[key] = open_source(s)
        slots.append(list(opened).index(key))
    uniq = list(opened.values())
    aligned = AlignedTensors(uniq, labels=[f"{i}:{s.label}" for i, s in enumerate(uniq)])
    records = []
    for name, tensors in aligned:
        t = [tensors[i] for i in slots]
        if include is not None and not include(name):
            continue
        if t[0].dim() != 2 or layer_type(name) == "norm" or not t[0].is_floating_point():
            continue
        if len({tuple(x.shape) for x in t}) != 1:
            raise CheckpointError(f"{name}: shapes differ between checkpoints: {[tuple(x.shape) for x in t]}")
        rec: dict[str, Any] = {"name": name, "type": layer_type(name), "layer": layer_index(name)}
        rec.update(mask_overlap_tensors(*t, top_percent=top_percent))
        records.append(rec)
        del tensors, t
    if not records:
        raise CheckpointError("no weight matrices in common between the checkpoints of the two updates")

    def summarize(recs: list[dict]) -> dict:
        vals = [r["jaccard"] for r in recs if math.isfinite(r["jaccard"])]
        inter = sum(r["intersection"] for r in recs)
        union = sum(r["union"] for r in recs)
        return {
            "n": len(recs),
            "jaccard_mean": sum(vals) / len(vals) if vals else math.nan,
            "jaccard_pooled": inter / union if union else math.nan,
            "chance": recs[0]["chance"] if recs else math.nan,
        }

    by_type, by_layer = _grouped(records)
    labels = [s.label for s in uniq]
    return {
        "update1": [labels[slots[0]], labels[slots[1]]],
        "update2": [labels[slots[2]], labels[slots[3]]],
        "top_percent": top_percent,
        "matrices": records,
        "summary": summarize(records),
        "by_type": {k: summarize(v) for k, v in sorted(by_type.items())},
        "by_layer": {str(k): summarize(v) for k, v in sorted(by_layer.items())},
        "missing": aligned.missing,
    }


# -- principal weights -----------------------------------------------------------------------
# "Principal weights" as the SDPO-CL paper (Wang et al. 2026, "Denser != Better", arXiv
# 2607.01763) uses the term, after its reference "The Path Not Taken: RLVR Provably Learns Off
# the Principals" (Zhu et al. 2025, arXiv 2511.08567), which takes the definition of LIFT (Liu et
# al. 2025, arXiv 2506.00772): the entries of largest magnitude in the rank-r reconstruction
# W_r = U_r diag(s_r) V_r^T of the weight matrix *before* the update. RLVR's update lands on them
# less often than a random mask would ("off the principals"); SFT targets them. The rank and the
# share are our choices (the papers tune them per model): r = diagnostics.svd_rank and the same
# top-p% as the update mask, so both masks have the same density and chance is p.


def principal_mask(
    w: torch.Tensor, *, rank: int, top_percent: float, exact_max_dim: int = 512, seed: int = 0
) -> torch.Tensor:
    """Bool mask [numel] (row-major) of the top-`top_percent`% entries of |W_r|, W_r the rank-`rank`
    reconstruction of w [m, n] (exact SVD up to min(m, n) = exact_max_dim, randomized above)."""
    if w.dim() != 2:
        raise ValueError(f"principal_mask needs a 2-D tensor, got shape {tuple(w.shape)}")
    if not 0.0 < top_percent <= 100.0:
        raise ValueError(f"top_percent must be in (0, 100], got {top_percent}")
    u, s, v, _ = top_singular(w.to(torch.float32), max(1, min(rank, *w.shape)), exact_max_dim=exact_max_dim, seed=seed)
    recon = (u * s) @ v.T
    flat = recon.reshape(-1).abs()
    k = max(1, min(flat.numel(), round(flat.numel() * top_percent / 100.0)))
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[torch.topk(flat, k, sorted=False).indices] = True
    return mask


def principal_overlap_tensors(
    w0: torch.Tensor,
    w1: torch.Tensor,
    *,
    rank: int,
    top_percent: float = 1.0,
    exact_max_dim: int = 512,
    seed: int = 0,
) -> dict:
    """Overlap of the update w0 -> w1's top-p% |dW| mask U with the principal-weight mask P of w0.

    Returns {"share": |U & P| / |U| (the share of the update on principal weights; NaN when
    nothing moved), "jaccard": |U & P| / |U | P|, "intersection", "update_k" (|U|: entries that
    moved, at most k), "principal_k" (|P|), "chance": |P| / numel, the share a random mask of any
    size would have}. share / chance > 1: the update targets principal weights; < 1: off them.
    """
    if w0.shape != w1.shape or w0.dim() != 2:
        raise ValueError(f"principal overlap needs two equal 2-D shapes, got {tuple(w0.shape)}, {tuple(w1.shape)}")
    if not 0.0 < top_percent <= 100.0:
        raise ValueError(f"top_percent must be in (0, 100], got {top_percent}")
    numel = w0.numel()
    k = max(1, min(numel, round(numel * top_percent / 100.0)))
    upd = _top_mask(w1.to(torch.float32) - w0.to(torch.float32), k)
    prin = principal_mask(w0, rank=rank, top_percent=top_percent, exact_max_dim=exact_max_dim, seed=seed)
    inter = int((upd & prin).sum())
    n_upd, n_prin = int(upd.sum()), int(prin.sum())
    union = n_upd + n_prin - inter
    return {
        "share": inter / n_upd if n_upd else math.nan,
        "jaccard": inter / union if union else math.nan,
        "intersection": inter,
        "update_k": n_upd,
        "principal_k": n_prin,
        "chance": n_prin / numel,
    }


def principal_weight_overlap(
    a: SourceLike,
    b: SourceLike,
    *,
    rank: int = 16,
    top_percent: float = 1.0,
    exact_max_dim: int = 512,
    include: Callable[[str], bool] | None = None,
    seed: int = 0,
) -> dict:
    """principal_overlap_tensors for every 2-D weight matrix of the update a -> b (principal
    weights of a), streamed; per layer type and overall: mean share and the pooled share (sum of
    intersections / sum of update sizes), with chance and pooled share / chance."""
    src_a, src_b = open_source(a), open_source(b)
    aligned = AlignedTensors([src_a, src_b], labels=["a", "b"])
    records = []
    for name, (ta, tb) in aligned:
        if include is not None and not include(name):
            continue
        if ta.dim() != 2 or layer_type(name) == "norm" or not ta.is_floating_point():
            continue
        if ta.shape != tb.shape:
            raise CheckpointError(
                f"{name}: shape {tuple(ta.shape)} in {src_a.label} but {tuple(tb.shape)} in {src_b.label}"
            )
        rec: dict[str, Any] = {"name": name, "type": layer_type(name), "layer": layer_index(name)}
        rec.update(
            principal_overlap_tensors(
                ta, tb, rank=rank, top_percent=top_percent, exact_max_dim=exact_max_dim, seed=seed
            )
        )
        records.append(rec)
        del ta, tb
    if not records:
        raise CheckpointError(f"no weight matrices in common between {src_a.label} and {src_b.label}")

    def summarize(recs: list[dict]) -> dict:
        shares = [r["share"] for r in recs if math.isfinite(r["share"])]
        inter = sum(r["intersection"] for r in recs)
        moved = sum(r["update_k"] for r in recs)
        chance = sum(r["principal_k"] for r in recs) / sum(r["principal_k"] / r["chance"] for r in recs)
        pooled = inter / moved if moved else math.nan
        return {
            "n": len(recs),
            "share_mean": sum(shares) / len(shares) if shares else math.nan,
            "share_pooled": pooled,
            "chance": chance,
            "share_over_chance": pooled / chance if chance > 0 else math.nan,
        }

    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_type[r["type"]].append(r)
    return {
        "a": src_a.label,
        "b": src_b.label,
        "rank": rank,
        "top_percent": top_percent,
        "matrices": records,
        "summary": summarize(records),
        "by_type": {k: summarize(v) for k, v in sorted(by_type.items())},
    }


def norm_drift(references: Mapping[str, SourceLike], b: SourceLike) -> dict:
    """Relative change ||B - A||_F / ||A||_F of source b against each reference A, norms only (no
    SVD: cheap enough to run every few training steps on a streamed export).

    references: {label: source}; b: the current weights (a one-pass stream is read once).
    Returns {label: {"n", "rel_frob_pooled", "by_type": {type: rel_frob_pooled}}} over the 2-D
    weight matrices (norms excluded), pooled as in `aggregate_drift`; fp64 sums of squares."""
    labels = list(references)
    if not labels:
        raise ValueError("norm_drift needs at least one reference")
    aligned = AlignedTensors([*references.values(), b], labels=[*labels, "current"])
    sq: dict[str, dict[str, list[float]]] = {lab: defaultdict(lambda: [0.0, 0.0]) for lab in labels}
    matrices = 0
    for name, tensors in aligned:
        cur = tensors[-1]
        if cur.dim() != 2 or layer_type(name) == "norm" or not cur.is_floating_point():
            continue
        matrices += 1
        kind = layer_type(name)
        c = cur.to(torch.float64)
        for lab, ref in zip(labels, tensors[:-1], strict=True):
            if ref.shape != cur.shape:
                raise CheckpointError(f"{name}: shape {tuple(ref.shape)} in {lab} but {tuple(cur.shape)} now")
            r = ref.to(torch.float64)
            acc = sq[lab][kind]
            acc[0] += float(r.square().sum())
            acc[1] += float((c - r).square().sum())
        del tensors, cur
    out = {}
    for lab in labels:
        groups = sq[lab]
        if not groups:
            raise CheckpointError(f"no weight matrices in common between {lab} and the current weights")
        total_a = sum(v[0] for v in groups.values())
        total_d = sum(v[1] for v in groups.values())
        out[lab] = {
            "n": matrices,
            "rel_frob_pooled": _ratio(math.sqrt(total_d), math.sqrt(total_a)),
            "by_type": {k: _ratio(math.sqrt(v[1]), math.sqrt(v[0])) for k, v in sorted(groups.items())},
        }
    return out
