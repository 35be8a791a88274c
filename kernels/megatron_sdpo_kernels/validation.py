"""Argument checks shared by every implementation: one clear line per mistake, before any work."""

from __future__ import annotations

import math

import torch

from megatron_sdpo.errors import ConfigError, UserError

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise UserError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise UserError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise UserError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_scalar_args(alpha: float | None, temperature: float) -> None:
    """Validate ``alpha`` (when given) and ``temperature``."""
    if alpha is not None:
        if isinstance(alpha, torch.Tensor) or not isinstance(alpha, (int, float)):
            raise ConfigError(f"alpha must be a Python float in [0, 1], got {alpha!r}")
        if not (0.0 <= float(alpha) <= 1.0) or math.isnan(float(alpha)):
            raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
    if not isinstance(temperature, (int, float)) or not temperature > 0 or math.isinf(temperature):
        raise ConfigError(f"temperature must be a finite float > 0, got {temperature!r}")


def _check_mask(mask: torch.Tensor | None, n: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise UserError(f"mask must be a bool tensor of shape [{n}], got {getattr(mask, 'dtype', type(mask))}")
    if tuple(mask.shape) != (n,):
        raise UserError(f"mask must have shape [{n}], got {tuple(mask.shape)}")


def check_kl_inputs(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_weight: torch.Tensor,
    alpha: float,
    temperature: float,
    mask: torch.Tensor | None,
) -> None:
    """Shapes ``[N, H]``, ``[N, H']``, ``[V, H]``, ``[V, H']``; same device; valid scalars."""
    for name, t in (
        ("student_hidden", student_hidden),
        ("teacher_hidden", teacher_hidden),
        ("student_weight", student_weight),
        ("teacher_weight", teacher_weight),
    ):
        _check_2d(name, t)
    n, h = student_hidden.shape
    if teacher_hidden.shape[0] != n:
        raise UserError(f"teacher_hidden has {teacher_hidden.shape[0]} tokens, student_hidden has {n}")
    if student_weight.shape[1] != h:
        raise UserError(f"student_weight is {tuple(student_weight.shape)}, expected [V, {h}] (student hidden size)")
    if teacher_weight.shape[1] != teacher_hidden.shape[1]:
        raise UserError(
            f"teacher_weight is {tuple(teacher_weight.shape)}, expected [V, {teacher_hidden.shape[1]}] "
            "(teacher hidden size)"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise UserError(
            f"student and teacher vocabularies differ: {student_weight.shape[0]} vs {teacher_weight.shape[0]} rows"
        )
    devices = {t.device for t in (student_hidden, teacher_hidden, student_weight, teacher_weight)}
    if len(devices) != 1:
        raise UserError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    check_scalar_args(alpha, temperature)
    _check_mask(mask, n)


def check_logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    mask: torch.Tensor | None,
    vocab_size: int | None = None,
) -> None:
    """``hidden [N, H]``, ``weight [V, H]``, ``labels [N]`` integer ids below ``vocab_size``.

    The id range is checked only for CPU labels: on a GPU it would cost a host synchronization.
    """
    _check_2d("hidden", hidden)
    _check_2d("weight", weight)
    n, h = hidden.shape
    if weight.shape[1] != h:
        raise UserError(f"weight is {tuple(weight.shape)}, expected [V, {h}]")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise UserError(f"labels must be an int64/int32 tensor of shape [{n}]")
    if tuple(labels.shape) != (n,):
        raise UserError(f"labels must have shape [{n}], got {tuple(labels.shape)}")
    v = weight.shape[0] if vocab_size is None else vocab_size
    _check_mask(mask, n)
    live = labels if mask is None else labels[mask]
    if labels.device.type == "cpu" and live.numel() > 0:
        lo, hi = int(live.min()), int(live.max())
        if lo < 0 or hi >= v:
            raise UserError(f"labels must be token ids in [0, {v}), got values in [{lo}, {hi}]")
    check_scalar_args(None, temperature)
