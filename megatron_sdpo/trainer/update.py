"""The optimizer step(s) on one rollout batch: one, or PPO/GRPO mini-batches with the old
log-probabilities of the rollout-time policy; rows without signal optionally left out."""

from __future__ import annotations

import torch

from megatron_sdpo.algorithms.minibatch import combine_step_metrics, split_groups
from megatron_sdpo.algorithms.signal_rows import PresetNormalizer, dropped_metrics, select_signal_rows
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import Backend, LossFn, SequenceBatch
from megatron_sdpo.rollout.guard import SEQ_WEIGHT, TOKEN_WEIGHT, attach_guard_tensors, mismatch_metrics


def minibatch_update(
    backend: Backend, batch: SequenceBatch, loss_fn: LossFn, *, mini_batches: int, group_size: int, skip: bool = False
) -> dict[str, float]:
    """`mini_batches` optimizer steps on `batch` through `backend.train_step`. With more than one,
    "old_logprobs" [B, T] of the current (rollout-time) policy are added to the batch first and
    the loss must read them (GRPOLoss(on_policy=False)); where the batch carries the refit
    guard's weights, the guard's numbers are measured on them. With `skip`, rows without signal
    leave every forward and backward (algorithms/signal_rows.py). Returns the combined metrics, with
    the first and last step's clip fraction and mean ratio where the loss reports them."""
    if mini_batches == 1:
        return _train_step(backend, batch, loss_fn, skip)
    if loss_fn.on_policy:
        raise ConfigError("several mini-batches need a loss that reads old_logprobs (on_policy=False)")
    guard = _old_logprobs(backend, batch, loss_fn, skip)
    steps = [_train_step(backend, mb, loss_fn, skip) for mb in split_groups(batch, mini_batches, group_size)]
    out = combine_step_metrics(steps)
    for key in ("grpo/clip_frac", "grpo/ratio_mean"):
        if key in steps[-1]:
            out[f"{key}_last"] = steps[-1][key]
    out.update(guard)
    return out


def _train_step(backend: Backend, batch: SequenceBatch, loss_fn: LossFn, skip: bool) -> dict[str, float]:
    """One optimizer step on `batch`; with `skip` on its rows with signal only (signal_rows.py)."""
    sel = select_signal_rows(batch, loss_fn, min_rows=backend.dp_size) if skip else None
    if sel is None:
        out = backend.train_step(batch, loss_fn)
        if skip:
            out["train/rows_skipped"] = 0.0
        return out
    sub = sel.batch
    if TOKEN_WEIGHT in sub.tensors:  # the guard's means over the trained rows
        attach_guard_tensors(sub.tensors, sub.response_mask(), rows=sel.trained)
    loss = PresetNormalizer(loss_fn, sel.normalizer, loss_fn.global_normalizer(sub.tensors))
    out = backend.train_step(sub, loss)
    out["samples"] = float(sel.rows)
    out["train/rows_skipped"] = float(sel.rows_skipped)
    return dropped_metrics(out, trained_rows=len(sel.kept))


def _old_logprobs(backend: Backend, batch: SequenceBatch, loss_fn: LossFn, skip: bool) -> dict[str, float]:
    """Adds "old_logprobs" (the rollout-time policy's; 0 on rows `skip` leaves out, which no
    step reads) and returns the refit guard's numbers on the rows it scored ({} without the
    guard's weights or with no row scored)."""
    t = batch.tensors
    sel = select_signal_rows(batch, loss_fn, min_rows=backend.dp_size) if skip else None
    weights = dict(t)
    if sel is None:
        t["old_logprobs"] = backend.logprobs(batch, model="policy").detach()
    else:
        lp = backend.logprobs(sel.batch, model="policy").detach()
        old = torch.zeros(len(batch), batch.max_response_len, dtype=lp.dtype, device=lp.device)
        old[sel.kept, : lp.shape[1]] = lp[sel.trained.to(lp.device)]
        t["old_logprobs"] = old
        if TOKEN_WEIGHT in t:
            scored = torch.zeros(len(batch), dtype=torch.bool)
            scored[sel.kept] = True
            attach_guard_tensors(weights, batch.response_mask(), rows=scored)
    if TOKEN_WEIGHT not in t or (sel is not None and not sel.kept):
        return {}
    old = t["old_logprobs"]
    guard = mismatch_metrics(
        old,
        t["rollout_logprobs"].to(old.device),
        weights[TOKEN_WEIGHT].to(old.device),
        weights[SEQ_WEIGHT].to(old.device),
    )
    return {k: float(v) for k, v in guard.items()}
