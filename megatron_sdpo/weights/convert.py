"""Tensor conversions that follow the plan: HF tensors <-> full megatron tensor <-> TP shards.

Every function is pure (no process groups) and copies: results never alias their inputs, and
shards are contiguous (gloo scatters/gathers of non-contiguous views silently corrupt data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Mapping as MappingT

import torch

from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.weights.plan import COLUMN, FC1, HEADS, REPLICATED, ROW, VOCAB, Layout, Mapping, ModelSpec, plan


def hf_to_full(spec: ModelSpec, mp: Mapping, hf: MappingT[str, torch.Tensor]) -> torch.Tensor:
    """The full (unsharded) megatron tensor of `mp` from HF tensors.

    linear_qkv: q [nh*D, H], k [nkv*D, H], v [nkv*D, H] -> [(nh + 2*nkv)*D, H] grouped as
    [q heads of group g, k_g, v_g] per query group. Vocab tensors [V, H] -> [V_padded, H], zero rows.
    """
    try:
        ts = [hf[n] for n in mp.hf]
    except KeyError as exc:
        raise CheckpointError(f"HF state dict is missing {exc.args[0]!r} (needed for {mp.megatron})") from None
    if mp.kind == COLUMN:
        q, k, v = ts
        G, D, H = spec.num_kv_heads, spec.head_dim, spec.hidden_size
        r = spec.num_heads // G
        full = torch.cat([q.reshape(G, r * D, H), k.reshape(G, D, H), v.reshape(G, D, H)], dim=1).reshape(-1, H)
    elif mp.kind == FC1:
        full = torch.cat(ts, dim=0)
    elif mp.kind == VOCAB:
        (w,) = ts
        full = torch.zeros(mp.shape, dtype=w.dtype, device=w.device)
        full[: w.shape[0]] = w
    else:
        (full,) = ts
        full = full.clone()
    if tuple(full.shape) != mp.shape:
        raise CheckpointError(f"{mp.megatron}: HF tensors give shape {tuple(full.shape)}, the plan expects {mp.shape}")
    return full.contiguous()


def full_to_hf(spec: ModelSpec, mp: Mapping, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_full`: HF-named tensors (padded vocabulary rows dropped)."""
    if mp.kind == COLUMN:
        G, D, H = spec.num_kv_heads, spec.head_dim, spec.hidden_size
        r = spec.num_heads // G
        g = full.reshape(G, (r + 2) * D, H)
        q, k, v = g[:, : r * D], g[:, r * D : (r + 1) * D], g[:, (r + 1) * D :]
        ts = [q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]
    elif mp.kind == FC1:
        ts = list(full.chunk(2, dim=0))
    elif mp.kind == VOCAB:
        ts = [full[: spec.vocab_size]]
    else:
        ts = [full]
    return {n: t.contiguous().clone() for n, t in zip(mp.hf, ts, strict=True)}


def shard(mp: Mapping, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s shard of a full megatron tensor."""
    if mp.kind in (COLUMN, VOCAB, HEADS):
        out = full.chunk(tp, dim=0)[rank]
    elif mp.kind == ROW:
        out = full.chunk(tp, dim=1)[rank]
    elif mp.kind == FC1:
        gate, up = full.chunk(2, dim=0)
        out = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    elif mp.kind == REPLICATED:
        out = full
    else:  # pragma: no cover - plan() only produces the kinds above
        raise ValueError(mp.kind)
    return out.contiguous().clone()


def unshard(mp: Mapping, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from all TP ranks' shards (rank order)."""
    if mp.kind in (COLUMN, VOCAB, HEADS):
        return torch.cat(shards, dim=0)
    if mp.kind == ROW:
        return torch.cat(shards, dim=1)
    if mp.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return shards[0].clone()


def hf_to_megatron(
    hf: MappingT[str, torch.Tensor], spec: ModelSpec, layout: Layout, tp_rank: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """The megatron state dict (parameters only) of one (TP rank, PP stage) from an HF state dict."""
    return {mp.megatron: shard(mp, hf_to_full(spec, mp, hf), layout.tp, tp_rank) for mp in plan(spec, layout, pp_rank)}


def megatron_to_hf(
    shards: Callable[[int, int], MappingT[str, torch.Tensor]], spec: ModelSpec, layout: Layout
) -> dict[str, torch.Tensor]:
    """An HF state dict from every rank's megatron state dict; `shards(tp_rank, pp_rank)` returns
    one rank's dict. With tied embeddings lm_head is omitted (HF re-ties it on load)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_hf(shards, spec, layout):
        out[name] = t
    return out


def iter_hf(
    shards: Callable[[int, int], MappingT[str, torch.Tensor]], spec: ModelSpec, layout: Layout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, tensor) pairs stage by stage; each megatron tensor is unsharded alone."""
    seen: set[str] = set()
    for p in range(layout.pp):
        sds = [shards(t, p) for t in range(layout.tp)]
        for mp in plan(spec, layout, p):
            if all(n in seen for n in mp.hf):
                continue  # the last stage's copy of a tied embedding
            try:
                parts = [sd[mp.megatron] for sd in sds]
            except KeyError:
                raise CheckpointError(f"megatron state dict of stage {p} is missing {mp.megatron!r}") from None
            for n, t in full_to_hf(spec, mp, unshard(mp, parts)).items():
                seen.add(n)
                yield n, t
