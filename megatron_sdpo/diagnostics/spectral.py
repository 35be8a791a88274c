"""Singular-value tools for drift: truncated SVD and principal angles between subspaces.

Large matrices (embeddings, MLP projections of a 7B model) use a seeded randomized subspace
iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4): memory O((m + n) * (k + p)) beyond the
matrix itself, and deterministic for a given seed, so identical inputs give identical factors.
"""

from __future__ import annotations

import math

import torch


def truncated_svd(
    x: torch.Tensor,
    k: int,
    *,
    oversample: int = 16,
    niter: int = 6,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-`k` singular triplets of `x` [m, n] by randomized subspace iteration.

    Returns U [m, k], S [k] (descending), V [n, k], all in `x`'s float dtype. Every power
    step re-orthonormalizes (QR) so the small singular values of the sketch are not lost to
    round-off; `niter` power steps sharpen the gap between sigma_k and sigma_{k+p}. Accuracy is
    tested against full SVD; for flat spectra raise `niter` / `oversample`.
    """
    if x.dim() != 2:
        raise ValueError(f"truncated_svd needs a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    k = min(k, m, n)
    q = min(k + oversample, m, n)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(n, q, generator=gen, dtype=x.dtype).to(x.device)
    basis = torch.linalg.qr(x @ omega).Q  # [m, q]
    for _ in range(niter):
        z = torch.linalg.qr(x.T @ basis).Q  # [n, q]
        basis = torch.linalg.qr(x @ z).Q
    small = basis.T @ x  # [q, n]: x ~= basis @ small
    ub, s, vh = torch.linalg.svd(small, full_matrices=False)
    u = basis @ ub
    return u[:, :k], s[:k], vh[:k].T


def top_singular(
    x: torch.Tensor,
    k: int | None,
    *,
    exact_max_dim: int = 512,
    oversample: int = 16,
    niter: int = 6,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Top-`k` singular triplets (all when `k` is None) of `x` [m, n], exact or randomized.

    Exact LAPACK SVD when min(m, n) <= `exact_max_dim` or `k` is None; randomized otherwise.
    Returns (U [m, k], S [k], V [n, k], method) with method "exact" or "randomized".
    """
    m, n = x.shape
    if k is None or min(m, n) <= exact_max_dim:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        kk = min(m, n) if k is None else min(k, m, n)
        return u[:, :kk], s[:kk], vh[:kk].T, "exact"
    u, s, v = truncated_svd(x, k, oversample=oversample, niter=niter, seed=seed)
    return u, s, v, "randomized"


def principal_angles(qa: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
    """Principal angles (degrees, ascending) between span(qa) and span(qb).

    qa [m, r], qb [m, r]: bases (orthonormal columns, e.g. fp32 singular vectors). Both are first
    re-orthonormalized in float64 (QR): fp32 singular vectors are orthonormal only to ~1e-7,
    and that alone read as ~3e-5 degrees between a subspace and itself. Cosines come from
    svd(qa^T qb), sines from svd(qb - qa qa^T qb); angle = atan2(sin, cos) pairing the largest
    cosine with the smallest sine, so small angles are accurate to round-off (arccos of a
    cosine near 1 is not). A sine below the float64 round-off of these products, 8 m eps, is
    indistinguishable from 0 and reads as exactly 0: identical subspaces give 0.0, not noise.
    """
    if qa.shape != qb.shape:
        raise ValueError(f"subspace shapes differ: {tuple(qa.shape)} vs {tuple(qb.shape)}")
    a = torch.linalg.qr(qa.to(torch.float64)).Q
    b = torch.linalg.qr(qb.to(torch.float64)).Q
    overlap = a.T @ b  # [r, r]
    cos = torch.linalg.svdvals(overlap).clamp(0.0, 1.0)  # descending
    sin = torch.linalg.svdvals(b - a @ overlap).clamp(0.0, 1.0)  # descending
    floor = 8.0 * a.shape[0] * torch.finfo(torch.float64).eps
    sin = torch.where(sin < floor, torch.zeros_like(sin), sin)
    angles = torch.atan2(sin.flip(0), cos)  # ascending
    return angles * (180.0 / math.pi)
