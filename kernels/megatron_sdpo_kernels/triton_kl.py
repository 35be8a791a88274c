"""Triton engine: same passes and outputs as ``chunked``, fused into tiled kernels.

Forward kernels run one program per block of BLOCK_N tokens and stream the local vocabulary in
BLOCK_V tiles; each logits tile is an fp32 accumulation of BLOCK_K slices of the hidden size
(``tl.dot`` accumulates in fp32, so bf16 products are never rounded before the fp32 cast). The
running max starts at -inf. The backward runs one program per (token block, vocabulary tile),
recomputes the two logits tiles, forms the fp32 logit gradient and adds its two products into
fp32 ``dh [N, H]`` and ``dw [V, H]`` buffers with atomics. No ``[N, V]`` buffer exists in any dtype
and nothing synchronizes with the host.

On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests); there ``tl.dot`` on bf16 is
wrong, so operands are cast to fp32 first (``DOT_FP32``), which on a GPU would waste the tensor
cores and is therefore only used for fp32 inputs (with IEEE precision, no TF32).

The kernel bodies necessarily restate the generalized JSD (``_kl_parts_kernel``) and its logit
gradient (``_kl_bwd_kernel``) of ``megatron_sdpo.algorithms.divergence``, the one definition;
tests/kernels hold them to it through the reference engine.
"""

from __future__ import annotations

import os

import torch

from megatron_sdpo.algorithms.divergence import mixture_log_coefs
from megatron_sdpo.errors import MissingDependencyError, UserError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_available(device: torch.device) -> None:
    """Raise a one-line error unless Triton can run on ``device`` (CUDA, or CPU interpreter)."""
    if triton is None:
        raise MissingDependencyError("impl='triton' needs triton; install it with `pip install -e .[gpu]`")
    if device.type == "cpu" and not _INTERPRET:
        raise UserError(
            "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before import (slow, for tests); "
            "use impl='chunked' on CPU"
        )
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"impl='triton' supports CUDA (or the CPU interpreter), got device {device}")


def _blocks(n: int, v: int, h: int) -> tuple[int, int, int]:
    if _INTERPRET:
        # The interpreter pays per program and per loop iteration: few, wide tiles.
        return 16, max(16, min(1024, triton.next_power_of_2(v))), max(16, min(128, triton.next_power_of_2(h)))
    return 64, 128, 64


if triton is not None:

    @triton.jit
    def _logits_tile(
        h_ptr,
        w_ptr,
        offs_n,
        offs_v,
        N,
        V,
        H,
        stride_h,
        stride_w,
        inv_t,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(
                h_ptr + offs_n[:, None] * stride_h + offs_k[None, :],
                mask=(offs_n[:, None] < N) & (offs_k[None, :] < H),
                other=0.0,
            )
            w = tl.load(
                w_ptr + offs_v[:, None] * stride_w + offs_k[None, :],
                mask=(offs_v[:, None] < V) & (offs_k[None, :] < H),
                other=0.0,
            )
            if DOT_FP32:
                acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(h, tl.trans(w), acc)
        return acc * inv_t

    @triton.jit
    def _kl_stats_kernel(
        hs_ptr,
        ht_ptr,
        ws_ptr,
        wt_ptr,
        out_ptr,
        N,
        V,
        HS,
        HT,
        stride_hs,
        stride_ht,
        stride_ws,
        stride_wt,
        inv_t,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_s = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        m_t = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s_s = tl.zeros((BLOCK_N,), tl.float32)
        s_t = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            valid = offs_v[None, :] < V
            zs = _logits_tile(
                hs_ptr,
                ws_ptr,
                offs_n,
                offs_v,
                N,
                V,
                HS,
                stride_hs,
                stride_ws,
                inv_t,
                BLOCK_N,
                BLOCK_V,
                BLOCK_K,
                DOT_FP32,
            )
            zt = _logits_tile(
                ht_ptr,
                wt_ptr,
                offs_n,
                offs_v,
                N,
                V,
                HT,
                stride_ht,
                stride_wt,
                inv_t,
                BLOCK_N,
                BLOCK_V,
                BLOCK_K,
                DOT_FP32,
            )
            zs = tl.where(valid, zs, float("-inf"))
            zt = tl.where(valid, zt, float("-inf"))
            ms_new = tl.maximum(m_s, tl.max(zs, 1))
            mt_new = tl.maximum(m_t, tl.max(zt, 1))
            s_s = s_s * tl.exp(m_s - ms_new) + tl.sum(tl.exp(zs - ms_new[:, None]), 1)
            s_t = s_t * tl.exp(m_t - mt_new) + tl.sum(tl.exp(zt - mt_new[:, None]), 1)
            m_s = ms_new
            m_t = mt_new
        row = offs_n < N
        tl.store(out_ptr + offs_n, m_s + tl.log(s_s), mask=row)
        tl.store(out_ptr + N + offs_n, m_t + tl.log(s_t), mask=row)

    @triton.jit
    def _kl_log_probs(
        hs_ptr,
        ht_ptr,
        ws_ptr,
        wt_ptr,
        lse_ptr,
        offs_n,
        offs_v,
        N,
        V,
        HS,
        HT,
        stride_hs,
        stride_ht,
        stride_ws,
        stride_wt,
        inv_t,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        row = offs_n < N
        lse_s = tl.load(lse_ptr + offs_n, mask=row, other=0.0)
        lse_t = tl.load(lse_ptr + N + offs_n, mask=row, other=0.0)
        zs = _logits_tile(
            hs_ptr, ws_ptr, offs_n, offs_v, N, V, HS, stride_hs, stride_ws, inv_t, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32
        )
        zt = _logits_tile(
            ht_ptr, wt_ptr, offs_n, offs_v, N, V, HT, stride_ht, stride_wt, inv_t, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32
        )
        return zs - lse_s[:, None], zt - lse_t[:, None]

    @triton.jit
    def _kl_parts_kernel(
        hs_ptr,
        ht_ptr,
        ws_ptr,
        wt_ptr,
        lse_ptr,
        out_ptr,
        N,
        V,
        HS,
        HT,
        stride_hs,
        stride_ht,
        stride_ws,
        stride_wt,
        inv_t,
        log_1ma,
        log_a,
        MODE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        p_s = tl.zeros((BLOCK_N,), tl.float32)
        p_q = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            valid = (offs_v[None, :] < V) & (offs_n[:, None] < N)
            a, b = _kl_log_probs(
                hs_ptr,
                ht_ptr,
                ws_ptr,
                wt_ptr,
                lse_ptr,
                offs_n,
                offs_v,
                N,
                V,
                HS,
                HT,
                stride_hs,
                stride_ht,
                stride_ws,
                stride_wt,
                inv_t,
                BLOCK_N,
                BLOCK_V,
                BLOCK_K,
                DOT_FP32,
            )
            if MODE == 0:
                p_q += tl.sum(tl.where(valid, tl.exp(b) * (b - a), 0.0), 1)
            elif MODE == 1:
                p_s += tl.sum(tl.where(valid, tl.exp(a) * (a - b), 0.0), 1)
            else:
                x = a + log_1ma
                y = b + log_a
                mx = tl.maximum(x, y)
                log_m = mx + tl.log(tl.exp(x - mx) + tl.exp(y - mx))
                p_s += tl.sum(tl.where(valid, tl.exp(a) * (a - log_m), 0.0), 1)
                p_q += tl.sum(tl.where(valid, tl.exp(b) * (b - log_m), 0.0), 1)
        row = offs_n < N
        tl.store(out_ptr + offs_n, p_s, mask=row)
        tl.store(out_ptr + N + offs_n, p_q, mask=row)

    @triton.jit
    def _accumulate_grads(
        gz,
        h_ptr,
        w_ptr,
        dh_ptr,
        dw_ptr,
        offs_n,
        offs_v,
        N,
        V,
        H,
        stride_h,
        stride_w,
        NEED_DH: tl.constexpr,
        NEED_DW: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k[None, :] < H
            if NEED_DH:
                w = tl.load(
                    w_ptr + offs_v[:, None] * stride_w + offs_k[None, :], mask=(offs_v[:, None] < V) & kmask, other=0.0
                ).to(tl.float32)
                if DOT_FP32:
                    part = tl.dot(gz, w, input_precision="ieee")
                else:
                    part = tl.dot(gz, w)
                tl.atomic_add(dh_ptr + offs_n[:, None] * H + offs_k[None, :], part, mask=(offs_n[:, None] < N) & kmask)
            if NEED_DW:
                h = tl.load(
                    h_ptr + offs_n[:, None] * stride_h + offs_k[None, :], mask=(offs_n[:, None] < N) & kmask, other=0.0
                ).to(tl.float32)
                if DOT_FP32:
                    part = tl.dot(tl.trans(gz), h, input_precision="ieee")
                else:
                    part = tl.dot(tl.trans(gz), h)
                tl.atomic_add(dw_ptr + offs_v[:, None] * H + offs_k[None, :], part, mask=(offs_v[:, None] < V) & kmask)

    @triton.jit
    def _kl_bwd_kernel(
        hs_ptr,
        ht_ptr,
        ws_ptr,
        wt_ptr,
        lse_ptr,
        resid_ptr,
        coef_ptr,
        dh_ptr,
        dw_ptr,
        N,
        V,
        HS,
        HT,
        stride_hs,
        stride_ht,
        stride_ws,
        stride_wt,
        inv_t,
        log_1ma,
        log_a,
        MODE: tl.constexpr,
        NEED_DH: tl.constexpr,
        NEED_DW: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row = offs_n < N
        valid = (offs_v[None, :] < V) & row[:, None]
        a, b = _kl_log_probs(
            hs_ptr,
            ht_ptr,
            ws_ptr,
            wt_ptr,
            lse_ptr,
            offs_n,
            offs_v,
            N,
            V,
            HS,
            HT,
            stride_hs,
            stride_ht,
            stride_ws,
            stride_wt,
            inv_t,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
            DOT_FP32,
        )
        coef = tl.load(coef_ptr + offs_n, mask=row, other=0.0)
        r = tl.load(resid_ptr + offs_n, mask=row, other=0.0)
        if MODE == 0:
            gz = tl.exp(a) - tl.exp(b)
        elif MODE == 1:
            gz = tl.exp(a) * (a - b - r[:, None])
        else:
            x = a + log_1ma
            y = b + log_a
            mx = tl.maximum(x, y)
            log_m = mx + tl.log(tl.exp(x - mx) + tl.exp(y - mx))
            gz = tl.exp(a) * (a - log_m - r[:, None])
        gz = tl.where(valid, gz * coef[:, None], 0.0)
        _accumulate_grads(
            gz,
            hs_ptr,
            ws_ptr,
            dh_ptr,
            dw_ptr,
            offs_n,
            offs_v,
            N,
            V,
            HS,
            stride_hs,
            stride_ws,
            NEED_DH,
            NEED_DW,
            BLOCK_K,
            DOT_FP32,
        )

    @triton.jit
    def _lp_stats_kernel(
        h_ptr,
        w_ptr,
        lab_ptr,
        out_ptr,
        N,
        V,
        H,
        stride_h,
        stride_w,
        inv_t,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = offs_n < N
        lab = tl.load(lab_ptr + offs_n, mask=row, other=-1)
        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        u = tl.zeros((BLOCK_N,), tl.float32)
        zl = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            valid = offs_v[None, :] < V
            z = _logits_tile(
                h_ptr, w_ptr, offs_n, offs_v, N, V, H, stride_h, stride_w, inv_t, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32
            )
            zl += tl.sum(tl.where(lab[:, None] == offs_v[None, :], z, 0.0), 1)
            z_inf = tl.where(valid, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z_inf, 1))
            scale = tl.exp(m - m_new)
            e = tl.exp(z_inf - m_new[:, None])
            s = s * scale + tl.sum(e, 1)
            # e is 0 on padded columns, where z is a finite 0: no 0 * -inf.
            u = u * scale + tl.sum(e * z, 1)
            m = m_new
        tl.store(out_ptr + offs_n, m, mask=row)
        tl.store(out_ptr + N + offs_n, s, mask=row)
        tl.store(out_ptr + 2 * N + offs_n, u, mask=row)
        tl.store(out_ptr + 3 * N + offs_n, zl, mask=row)

    @triton.jit
    def _lp_bwd_kernel(
        h_ptr,
        w_ptr,
        lab_ptr,
        lse_ptr,
        ent_ptr,
        glp_ptr,
        gent_ptr,
        dh_ptr,
        dw_ptr,
        N,
        V,
        H,
        stride_h,
        stride_w,
        inv_t,
        NEED_DH: tl.constexpr,
        NEED_DW: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row = offs_n < N
        valid = (offs_v[None, :] < V) & row[:, None]
        lab = tl.load(lab_ptr + offs_n, mask=row, other=-1)
        lse = tl.load(lse_ptr + offs_n, mask=row, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=row, other=0.0)
        glp = tl.load(glp_ptr + offs_n, mask=row, other=0.0)
        gent = tl.load(gent_ptr + offs_n, mask=row, other=0.0)
        a = (
            _logits_tile(
                h_ptr, w_ptr, offs_n, offs_v, N, V, H, stride_h, stride_w, inv_t, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32
            )
            - lse[:, None]
        )
        p = tl.exp(a)
        onehot = tl.where(lab[:, None] == offs_v[None, :], 1.0, 0.0)
        gz = glp[:, None] * (onehot - p) - gent[:, None] * p * (a + ent[:, None])
        gz = tl.where(valid, gz, 0.0)
        _accumulate_grads(
            gz,
            h_ptr,
            w_ptr,
            dh_ptr,
            dw_ptr,
            offs_n,
            offs_v,
            N,
            V,
            H,
            stride_h,
            stride_w,
            NEED_DH,
            NEED_DW,
            BLOCK_K,
            DOT_FP32,
        )


def _dot_fp32(*tensors: torch.Tensor) -> bool:
    return _INTERPRET or any(t.dtype == torch.float32 for t in tensors)


def _mode(alpha: float) -> tuple[int, float, float]:
    if alpha == 0.0:
        return 0, 0.0, 0.0
    if alpha == 1.0:
        return 1, 0.0, 0.0
    return 2, *mixture_log_coefs(alpha)


def _rowmajor(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # The kernels assume unit stride along the hidden dimension.
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def kl_stats(hs, ht, ws, wt, temperature: float) -> torch.Tensor:
    """Pass 1 (see ``chunked.kl_stats``): ``[2, N]`` fp32 local (lse_s, lse_t)."""
    hs, ht, ws, wt = _rowmajor(hs, ht, ws, wt)
    n, v = hs.shape[0], ws.shape[0]
    bn, bv, bk = _blocks(n, v, max(hs.shape[1], ht.shape[1]))
    out = torch.empty(2, n, dtype=torch.float32, device=hs.device)
    _kl_stats_kernel[(triton.cdiv(n, bn),)](
        hs,
        ht,
        ws,
        wt,
        out,
        n,
        v,
        hs.shape[1],
        ht.shape[1],
        hs.stride(0),
        ht.stride(0),
        ws.stride(0),
        wt.stride(0),
        1.0 / temperature,
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_K=bk,
        DOT_FP32=_dot_fp32(hs, ws),
    )
    return out


def kl_parts(hs, ht, ws, wt, temperature: float, lse: torch.Tensor, alpha: float) -> torch.Tensor:
    """Pass 2 (see ``chunked.kl_parts``): ``[2, N]`` fp32 local (P_s, P_q)."""
    hs, ht, ws, wt = _rowmajor(hs, ht, ws, wt)
    n, v = hs.shape[0], ws.shape[0]
    bn, bv, bk = _blocks(n, v, max(hs.shape[1], ht.shape[1]))
    mode, log_1ma, log_a = _mode(alpha)
    out = torch.empty(2, n, dtype=torch.float32, device=hs.device)
    _kl_parts_kernel[(triton.cdiv(n, bn),)](
        hs,
        ht,
        ws,
        wt,
        lse.contiguous(),
        out,
        n,
        v,
        hs.shape[1],
        ht.shape[1],
        hs.stride(0),
        ht.stride(0),
        ws.stride(0),
        wt.stride(0),
        1.0 / temperature,
        log_1ma,
        log_a,
        MODE=mode,
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_K=bk,
        DOT_FP32=_dot_fp32(hs, ws),
    )
    return out


def kl_backward(hs, ht, ws, wt, temperature: float, lse, resid, coef, alpha: float, need_dh: bool, need_dw: bool):
    """Student gradients (see ``chunked.kl_backward``): fp32 (``dh [N, H]``, ``dw [V_local, H]``)."""
    hs, ht, ws, wt = _rowmajor(hs, ht, ws, wt)
    n, v = hs.shape[0], ws.shape[0]
    bn, bv, bk = _blocks(n, v, max(hs.shape[1], ht.shape[1]))
    mode, log_1ma, log_a = _mode(alpha)
    dh = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device)
    dw = torch.zeros(ws.shape, dtype=torch.float32, device=hs.device) if need_dw else dh
    _kl_bwd_kernel[(triton.cdiv(n, bn), triton.cdiv(v, bv))](
        hs,
        ht,
        ws,
        wt,
        lse.contiguous(),
        resid.contiguous(),
        coef.contiguous(),
        dh,
        dw,
        n,
        v,
        hs.shape[1],
        ht.shape[1],
        hs.stride(0),
        ht.stride(0),
        ws.stride(0),
        wt.stride(0),
        1.0 / temperature,
        log_1ma,
        log_a,
        MODE=mode,
        NEED_DH=need_dh,
        NEED_DW=need_dw,
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_K=bk,
        DOT_FP32=_dot_fp32(hs, ws),
    )
    return (dh if need_dh else None), (dw if need_dw else None)


def lp_stats(h, w, local_labels, temperature: float) -> torch.Tensor:
    """Single pass (see ``chunked.lp_stats``): ``[4, N]`` fp32 (max, sumexp, sum exp*z, label logit)."""
    h, w = _rowmajor(h, w)
    n, v = h.shape[0], w.shape[0]
    bn, bv, bk = _blocks(n, v, h.shape[1])
    out = torch.empty(4, n, dtype=torch.float32, device=h.device)
    _lp_stats_kernel[(triton.cdiv(n, bn),)](
        h,
        w,
        local_labels.contiguous(),
        out,
        n,
        v,
        h.shape[1],
        h.stride(0),
        w.stride(0),
        1.0 / temperature,
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_K=bk,
        DOT_FP32=_dot_fp32(h, w),
    )
    return out


def lp_backward(h, w, local_labels, temperature: float, lse, entropy, g_lp, g_ent, need_dh: bool, need_dw: bool):
    """Gradients (see ``chunked.lp_backward``): fp32 (``dh [N, H]``, ``dw [V_local, H]``)."""
    h, w = _rowmajor(h, w)
    n, v = h.shape[0], w.shape[0]
    bn, bv, bk = _blocks(n, v, h.shape[1])
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_dw else dh
    _lp_bwd_kernel[(triton.cdiv(n, bn), triton.cdiv(v, bv))](
        h,
        w,
        local_labels.contiguous(),
        lse.contiguous(),
        entropy.contiguous(),
        g_lp,
        g_ent,
        dh,
        dw,
        n,
        v,
        h.shape[1],
        h.stride(0),
        w.stride(0),
        1.0 / temperature,
        NEED_DH=need_dh,
        NEED_DW=need_dw,
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_K=bk,
        DOT_FP32=_dot_fp32(h, w),
    )
    return (dh if need_dh else None), (dw if need_dw else None)
