"""Autograd wrappers and the public dispatch for the fused linear KL / logprob kernels.

An engine (``chunked`` or ``triton_kl``) computes per-token statistics over the local vocabulary
shard; this module runs the two passes, exchanges statistics between them when the vocabulary is
tensor-parallel, and defines the backward. Forward of ``fused_linear_kl``:

    pass 1  local lse of student and teacher         -> all-gather [P, 2, N], combine
    pass 2  local KL partial sums given global lse   -> all-reduce [2, N]
backward: recompute tiles, student gradients only; the hidden-state gradient is summed over the
tensor-parallel group here, so callers must *not* wrap the hidden states in Megatron's
``copy_to_tensor_model_parallel_region`` (that would sum it twice).
"""

from __future__ import annotations

import types

import torch

from megatron_sdpo.algorithms.divergence import combine_jsd_parts, jsd_grad_scale
from megatron_sdpo.errors import ConfigError

from . import chunked
from .chunked import ChunkSizes
from .parallel import all_reduce_sum, combine_lp_stats, combine_lse, gather_stats, group_size, vocab_start
from .reference import reference_linear_kl, reference_linear_logprobs
from .validation import check_kl_inputs, check_logprob_inputs

IMPLS = ("auto", "reference", "chunked", "triton")


def _engine(impl: str, device: torch.device) -> types.ModuleType:
    if impl == "chunked":
        return chunked
    if impl == "triton":
        from . import triton_kl  # imported lazily: triton is optional

        triton_kl.check_available(device)
        return triton_kl
    raise ConfigError(f"unknown impl {impl!r}")


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` (one of ``IMPLS``) to a concrete implementation for ``device``."""
    if impl not in IMPLS:
        raise ConfigError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return "triton" if device.type == "cuda" else "chunked"


class _LinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ht, ws, wt, mask, alpha, temperature, group, engine, chunks):
        kw = {"chunks": chunks} if engine is chunked else {}
        with torch.no_grad():
            lse = combine_lse(gather_stats(engine.kl_stats(hs, ht, ws, wt, temperature, **kw), group))
            parts = all_reduce_sum(engine.kl_parts(hs, ht, ws, wt, temperature, lse, alpha, **kw), group)
            # A fresh tensor: `parts` is saved for the backward and must not alias the output.
            loss = combine_jsd_parts(parts[0], parts[1], alpha).clone()
            if mask is not None:
                loss = torch.where(mask, loss, torch.zeros_like(loss))
        ctx.save_for_backward(hs, ht, ws, wt, lse, parts[0].contiguous(), mask)
        ctx.cfg = (alpha, temperature, group, engine, kw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hs, ht, ws, wt, lse, resid, mask = ctx.saved_tensors
        alpha, temperature, group, engine, kw = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        if not (need_dh or need_dw):
            return (None,) * 10
        coef = grad_loss.float() / temperature * jsd_grad_scale(alpha)
        if mask is not None:
            coef = torch.where(mask, coef, torch.zeros_like(coef))
        dh, dw = engine.kl_backward(
            hs, ht, ws, wt, temperature, lse, resid, coef.contiguous(), alpha, need_dh, need_dw, **kw
        )
        if dh is not None:
            dh = all_reduce_sum(dh, group).to(hs.dtype)
        if dw is not None:
            dw = dw.to(ws.dtype)
        return dh, None, dw, None, None, None, None, None, None, None


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, mask, temperature, group, engine, chunks, start):
        kw = {"chunks": chunks} if engine is chunked else {}
        with torch.no_grad():
            local_labels = (labels.long() - start).contiguous()
            stats = engine.lp_stats(h, w, local_labels, temperature, **kw)
            lse, mean_z, z_label = combine_lp_stats(gather_stats(stats, group))
            logprobs = z_label - lse
            entropy = lse - mean_z
            if mask is not None:
                zero = torch.zeros_like(logprobs)
                logprobs = torch.where(mask, logprobs, zero)
                entropy = torch.where(mask, entropy, zero)
        ctx.save_for_backward(h, w, local_labels, lse, entropy, mask)
        ctx.cfg = (temperature, group, engine, kw)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, local_labels, lse, entropy, mask = ctx.saved_tensors
        temperature, group, engine, kw = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return (None,) * 9
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float() / temperature
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float() / temperature
        if mask is not None:
            g_lp = torch.where(mask, g_lp, torch.zeros_like(g_lp))
            g_ent = torch.where(mask, g_ent, torch.zeros_like(g_ent))
        dh, dw = engine.lp_backward(
            h,
            w,
            local_labels,
            temperature,
            lse,
            entropy,
            g_lp.contiguous(),
            g_ent.contiguous(),
            need_dh,
            need_dw,
            **kw,
        )
        if dh is not None:
            dh = all_reduce_sum(dh, group).to(h.dtype)
        if dw is not None:
            dw = dw.to(w.dtype)
        return dh, dw, None, None, None, None, None, None, None


def fused_linear_kl(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    alpha: float,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    impl: str = "auto",
    tp_group=None,
    chunk_sizes: ChunkSizes | None = None,
) -> torch.Tensor:
    """Per-token generalized JSD between student and teacher, straight from hidden states.

    Never builds ``[N, V]`` (except ``impl="reference"``, the specification). Gradients flow to
    ``student_hidden`` and ``student_weight`` only; the teacher is a constant.

    Args:
        student_hidden: ``[N, H]`` (fp32 / bf16 / fp16), replicated over ``tp_group``.
        teacher_hidden: ``[N, H_t]``, replicated over ``tp_group``.
        student_weight: ``[V_local, H]``: the whole LM head, or this rank's contiguous vocab shard.
        teacher_weight: ``[V_local, H_t]``, sharded like ``student_weight``.
        alpha: 0 = KL(teacher || student), 1 = KL(student || teacher), else the generalized JSD.
        temperature: divides both models' logits.
        mask: optional ``[N]`` bool; False tokens give loss 0 and no gradient.
        impl: "auto" (Triton on CUDA, chunked on CPU), "reference", "chunked" or "triton".
        tp_group: tensor-parallel process group over which the vocabulary is sharded, or None.
        chunk_sizes: tile sizes of the chunked engine (None: ``ChunkSizes()``).

    Returns:
        ``[N]`` fp32 per-token loss, identical on every rank of ``tp_group``.
    """
    check_kl_inputs(student_hidden, teacher_hidden, student_weight, teacher_weight, alpha, temperature, mask)
    alpha, temperature = float(alpha), float(temperature)
    impl = resolve_impl(impl, student_hidden.device)
    if impl == "reference":
        if group_size(tp_group) > 1:
            raise ConfigError("impl='reference' does not support a sharded vocabulary (tp_group of size > 1)")
        return reference_linear_kl(
            student_hidden,
            teacher_hidden,
            student_weight,
            teacher_weight,
            alpha=alpha,
            temperature=temperature,
            mask=mask,
        )
    engine = _engine(impl, student_hidden.device)
    if student_hidden.shape[0] == 0:
        # An empty micro-batch (e.g. no sample had a teacher): keep the graph, skip the kernels.
        return (student_hidden.sum() * 0 + student_weight.sum() * 0).float().expand(0)
    return _LinearKL.apply(
        student_hidden,
        teacher_hidden.detach(),
        student_weight,
        teacher_weight.detach(),
        mask,
        alpha,
        temperature,
        tp_group,
        engine,
        chunk_sizes or ChunkSizes(),
    )


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    impl: str = "auto",
    tp_group=None,
    chunk_sizes: ChunkSizes | None = None,
    shard_start: int | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probability of ``labels`` and softmax entropy, straight from hidden states.

    Args:
        hidden: ``[N, H]``, replicated over ``tp_group``.
        weight: ``[V_local, H]``: the LM head or this rank's contiguous vocab shard.
        labels: ``[N]`` global token ids (masked-out tokens may hold anything, e.g. -100).
        temperature: divides the logits.
        mask: optional ``[N]`` bool; False tokens return 0 for both outputs and get no gradient.
        impl, tp_group, chunk_sizes: as in :func:`fused_linear_kl`.
        shard_start: first global id of this rank's rows when the shards are not equal (e.g. a
            padded vocabulary whose last shards are cut at the real size); default
            ``rank * V_local``.
        vocab_size: the real vocabulary size the labels index (default ``V_local * tp``).

    Returns:
        ``(logprobs [N], entropy [N])`` fp32, both differentiable w.r.t. ``hidden`` and ``weight``.
    """
    vocab = weight.shape[0] * group_size(tp_group) if vocab_size is None else vocab_size
    check_logprob_inputs(hidden, weight, labels, temperature, mask, vocab_size=vocab)
    impl = resolve_impl(impl, hidden.device)
    if impl == "reference":
        if group_size(tp_group) > 1:
            raise ConfigError("impl='reference' does not support a sharded vocabulary (tp_group of size > 1)")
        return reference_linear_logprobs(hidden, weight, labels, temperature=float(temperature), mask=mask)
    engine = _engine(impl, hidden.device)
    if hidden.shape[0] == 0:
        empty = (hidden.sum() * 0 + weight.sum() * 0).float().expand(0)
        return empty, empty.clone()
    start = vocab_start(tp_group, weight.shape[0]) if shard_start is None else int(shard_start)
    return _LinearLogprobs.apply(
        hidden, weight, labels, mask, float(temperature), tp_group, engine, chunk_sizes or ChunkSizes(), start
    )
