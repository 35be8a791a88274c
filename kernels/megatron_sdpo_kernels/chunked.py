"""Chunked torch engine: tiles over tokens and vocabulary, never builds ``[N, V]``.

Each function works on the *local* vocabulary shard (the whole vocabulary when not tensor
parallel) and returns fp32 per-token statistics; ``fused.py`` combines them across ranks and
wraps them in autograd. Peak extra memory is a few ``[token_chunk, vocab_chunk]`` fp32 tiles plus
the fp32 weight-gradient accumulator.

The divergence and its gradient with respect to the student logits are the tile-level pieces of
`megatron_sdpo.algorithms.divergence` (`jsd_part_sums`, `jsd_logit_grad`); only the tiling, the
online log-sum-exp and the GEMMs live here. For labels/entropy the logit gradient is
g_lp * (onehot - s) - g_H * s * (a + H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sdpo.algorithms.divergence import jsd_logit_grad, jsd_part_sums

NEG_INF = float("-inf")


@dataclass(frozen=True)
class ChunkSizes:
    """Tile sizes: tokens per chunk and vocabulary rows per chunk."""

    tokens: int = 1024
    vocab: int = 8192


def _ranges(total: int, step: int):
    for lo in range(0, total, step):
        yield lo, min(lo + step, total)


def _logits(h: torch.Tensor, w: torch.Tensor, inv_t: float) -> torch.Tensor:
    # fp32 GEMM: upcast the operands, never round a bf16 product before the cast.
    return (h @ w.float().t()).mul_(inv_t)


def _online_update(m: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # m starts at -inf, so exp(m - m_new) is exactly 0 on the first tile.
    m_new = torch.maximum(m, z.amax(dim=-1))
    s = s * torch.exp(m - m_new) + torch.exp(z - m_new.unsqueeze(-1)).sum(dim=-1)
    return m_new, s


def _grad_buffers(
    h: torch.Tensor, w: torch.Tensor, need_dh: bool, need_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    # fp32 accumulators: tiles add many bf16 products, which a bf16 sum would round each time.
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_dh else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_dw else None
    return dh, dw


def _add_tile_grads(
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
    gz: torch.Tensor,
    h_c: torch.Tensor,
    w: torch.Tensor,
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> None:
    """Adds the logit gradient `gz` of one tile (tokens `rows`, vocabulary `cols`) to dh and dw."""
    (i0, i1), (j0, j1) = rows, cols
    if dh is not None:
        dh[i0:i1] += gz @ w[j0:j1].float()
    if dw is not None:
        dw[j0:j1] += gz.t() @ h_c


def kl_stats(
    hs: torch.Tensor,
    ht: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    temperature: float,
    chunks: ChunkSizes = ChunkSizes(),
) -> torch.Tensor:
    """Pass 1: local log-sum-exp of student and teacher logits.

    Args: hs/ht ``[N, H]``, ws/wt ``[V_local, H]``.
    Returns: ``[2, N]`` fp32, rows (lse_student, lse_teacher) over the local vocabulary.
    """
    n, v = hs.shape[0], ws.shape[0]
    inv_t = 1.0 / temperature
    out = torch.empty(2, n, dtype=torch.float32, device=hs.device)
    for i0, i1 in _ranges(n, chunks.tokens):
        hs_c, ht_c = hs[i0:i1].float(), ht[i0:i1].float()
        m_s = torch.full((i1 - i0,), NEG_INF, device=hs.device)
        m_t = torch.full_like(m_s, NEG_INF)
        s_s = torch.zeros_like(m_s)
        s_t = torch.zeros_like(m_s)
        for j0, j1 in _ranges(v, chunks.vocab):
            m_s, s_s = _online_update(m_s, s_s, _logits(hs_c, ws[j0:j1], inv_t))
            m_t, s_t = _online_update(m_t, s_t, _logits(ht_c, wt[j0:j1], inv_t))
        out[0, i0:i1] = m_s + torch.log(s_s)
        out[1, i0:i1] = m_t + torch.log(s_t)
    return out


def _log_probs_tile(hs_c, ht_c, ws, wt, j0, j1, inv_t, lse_s, lse_t):
    a = _logits(hs_c, ws[j0:j1], inv_t).sub_(lse_s.unsqueeze(-1))
    b = _logits(ht_c, wt[j0:j1], inv_t).sub_(lse_t.unsqueeze(-1))
    return a, b


def kl_parts(
    hs: torch.Tensor,
    ht: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    alpha: float,
    chunks: ChunkSizes = ChunkSizes(),
) -> torch.Tensor:
    """Pass 2: local partial sums of the two KL terms given the *global* log-sum-exps.

    Args: ``lse`` ``[2, N]`` global (lse_student, lse_teacher).
    Returns: ``[2, N]`` fp32 (P_s, P_q): alpha=0 -> (0, KL(q||s)); alpha=1 -> (KL(s||q), 0);
    else (KL(s||M), KL(q||M)), each summed over the local vocabulary only.
    """
    n, v = hs.shape[0], ws.shape[0]
    inv_t = 1.0 / temperature
    out = torch.zeros(2, n, dtype=torch.float32, device=hs.device)
    for i0, i1 in _ranges(n, chunks.tokens):
        hs_c, ht_c = hs[i0:i1].float(), ht[i0:i1].float()
        lse_s, lse_t = lse[0, i0:i1], lse[1, i0:i1]
        for j0, j1 in _ranges(v, chunks.vocab):
            a, b = _log_probs_tile(hs_c, ht_c, ws, wt, j0, j1, inv_t, lse_s, lse_t)
            p_s, p_q = jsd_part_sums(a, b, alpha)
            out[0, i0:i1] += p_s
            out[1, i0:i1] += p_q
    return out


def kl_backward(
    hs: torch.Tensor,
    ht: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    resid: torch.Tensor,
    coef: torch.Tensor,
    alpha: float,
    need_dh: bool,
    need_dw: bool,
    chunks: ChunkSizes = ChunkSizes(),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Recompute tiles and accumulate the student gradients in fp32.

    Args: ``lse`` ``[2, N]`` global; ``resid`` ``[N]`` the complete P_s of ``kl_parts``;
    ``coef`` ``[N]`` = grad_output * mask / T * ``jsd_grad_scale(alpha)``.
    Returns: (``dh [N, H]`` partial over the local vocabulary, ``dw [V_local, H]``), fp32.
    """
    n, v = hs.shape[0], ws.shape[0]
    inv_t = 1.0 / temperature
    dh, dw = _grad_buffers(hs, ws, need_dh, need_dw)
    for i0, i1 in _ranges(n, chunks.tokens):
        hs_c, ht_c = hs[i0:i1].float(), ht[i0:i1].float()
        lse_s, lse_t = lse[0, i0:i1], lse[1, i0:i1]
        c = coef[i0:i1].unsqueeze(-1)
        r = resid[i0:i1].unsqueeze(-1)
        for j0, j1 in _ranges(v, chunks.vocab):
            a, b = _log_probs_tile(hs_c, ht_c, ws, wt, j0, j1, inv_t, lse_s, lse_t)
            gz = jsd_logit_grad(a, b, alpha, r).mul_(c)
            _add_tile_grads(dh, dw, gz, hs_c, ws, (i0, i1), (j0, j1))
    return dh, dw


def lp_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    local_labels: torch.Tensor,
    temperature: float,
    chunks: ChunkSizes = ChunkSizes(),
) -> torch.Tensor:
    """Single pass for logprobs and entropy over the local vocabulary.

    Args: ``h [N, H]``, ``w [V_local, H]``, ``local_labels [N]`` (label minus the shard's first
    id; anything outside ``[0, V_local)`` simply never matches).
    Returns: ``[4, N]`` fp32 rows (max, sum exp(z - max), sum exp(z - max) * z, label logit or 0).
    """
    n, v = h.shape[0], w.shape[0]
    inv_t = 1.0 / temperature
    out = torch.empty(4, n, dtype=torch.float32, device=h.device)
    for i0, i1 in _ranges(n, chunks.tokens):
        h_c = h[i0:i1].float()
        lab = local_labels[i0:i1].unsqueeze(-1)
        m = torch.full((i1 - i0,), NEG_INF, device=h.device)
        s = torch.zeros_like(m)
        u = torch.zeros_like(m)
        zl = torch.zeros_like(m)
        for j0, j1 in _ranges(v, chunks.vocab):
            z = _logits(h_c, w[j0:j1], inv_t)
            m_new = torch.maximum(m, z.amax(dim=-1))
            scale = torch.exp(m - m_new)
            e = torch.exp(z - m_new.unsqueeze(-1))
            s = s * scale + e.sum(-1)
            u = u * scale + (e * z).sum(-1)
            m = m_new
            cols = torch.arange(j0, j1, device=h.device)
            zl += torch.where(lab == cols, z, torch.zeros((), device=h.device)).sum(-1)
        out[0, i0:i1], out[1, i0:i1], out[2, i0:i1], out[3, i0:i1] = m, s, u, zl
    return out


def lp_backward(
    h: torch.Tensor,
    w: torch.Tensor,
    local_labels: torch.Tensor,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    need_dh: bool,
    need_dw: bool,
    chunks: ChunkSizes = ChunkSizes(),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``sum(g_lp * logprob + g_ent * entropy)`` (``g_*`` already hold mask / T).

    Returns: (``dh [N, H]`` partial over the local vocabulary, ``dw [V_local, H]``), fp32.
    """
    n, v = h.shape[0], w.shape[0]
    inv_t = 1.0 / temperature
    dh, dw = _grad_buffers(h, w, need_dh, need_dw)
    for i0, i1 in _ranges(n, chunks.tokens):
        h_c = h[i0:i1].float()
        lab = local_labels[i0:i1].unsqueeze(-1)
        gl, ge = g_lp[i0:i1].unsqueeze(-1), g_ent[i0:i1].unsqueeze(-1)
        lse_c, ent_c = lse[i0:i1].unsqueeze(-1), entropy[i0:i1].unsqueeze(-1)
        for j0, j1 in _ranges(v, chunks.vocab):
            a = _logits(h_c, w[j0:j1], inv_t).sub_(lse_c)
            p = a.exp()
            cols = torch.arange(j0, j1, device=h.device)
            gz = (lab == cols).float().mul_(gl) - p * gl - p * (a + ent_c) * ge
            _add_tile_grads(dh, dw, gz, h_c, w, (i0, i1), (j0, j1))
    return dh, dw
