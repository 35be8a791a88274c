"""Rows without signal leave the train step, exactly.

With no KL term, a GRPO row whose advantages are all 0 adds exactly 0 to the loss and to every
gradient (clip-higher, dual clip and the importance weights all multiply the advantage), and so
does an SDPO row whose distillation mask is empty (no teacher context, chain-of-thought masking,
`mask_ratio`); `LossFn.signal_rows` says which rows those are. The trainer then runs the
forward and backward on the other rows only, with the loss normalizer of the whole mini-batch:
the loss, the gradient, `grad_norm`, the optimizer step and its state are the unskipped step's
up to float round-off (sums run over fewer terms, in another order).

Two things must still happen when rows leave:
- every data-parallel rank runs the step (its forward-backward schedule and the gradient
  reduction are collectives): a mini-batch with fewer rows with signal than DP ranks keeps
  placeholder rows, skipped rows cut to their last prompt token and first response token with
  every tensor in `LossFn.mask_keys` zeroed, which add exactly 0 to the loss, the gradient and
  the metrics;
- a mini-batch whose every row is skipped still takes its optimizer step, with zero gradients
  (AdamW's moments decay and its decoupled weight decay applies, as in the unskipped step): the
  placeholders' backward gives every parameter its zero gradient (a parameter whose gradient
  were None would be left out of the step).

Metrics: the loss's shares whose name holds "loss" are the whole mini-batch's (equal to the
unskipped step's); its other token means (ratio, clip fractions, entropies, IS weights) and
extrema are over the trained rows' tokens, as verl reports them after DAPO's filtering, and are
left out for a term with no trained token. "samples" counts the mini-batch's rows and
"train/rows_skipped" those left out (placeholders included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sdpo.interfaces.backend import LossFn, SequenceBatch


@dataclass
class Selection:
    """What the backend trains instead of a mini-batch.

    batch: the rows with signal, in order, and the placeholders; per-token tensors cut to its
        longest response. trained: [len(batch)] bool, False on placeholders. kept: the trained
        rows' indices in the mini-batch.
    rows: the mini-batch's rows. normalizer: the mini-batch's loss normalizer."""

    batch: SequenceBatch
    trained: torch.Tensor
    kept: list[int]
    rows: int
    normalizer: torch.Tensor

    @property
    def rows_skipped(self) -> int:
        return self.rows - len(self.kept)


def select_signal_rows(batch: SequenceBatch, loss_fn: LossFn, *, min_rows: int = 1) -> Selection | None:
    """The rows of `batch` with signal plus placeholders up to `min_rows` rows (the backend's DP
    size); None when every row has signal (the batch trains as it is)."""
    signal = loss_fn.signal_rows(batch.tensors).to(torch.bool).cpu().tolist()
    keep = [i for i, s in enumerate(signal) if s]
    if len(keep) == len(batch):
        return None
    # The cheapest skipped rows hold the places.
    skipped = sorted(
        (i for i, s in enumerate(signal) if not s), key=lambda i: len(batch.prompt_ids[i]) + len(batch.response_ids[i])
    )
    places = set(skipped[: max(0, min_rows - len(keep))])
    idx = sorted(set(keep) | places)
    sub = batch.select(idx)
    prompts, responses = list(sub.prompt_ids), list(sub.response_ids)
    teacher = list(sub.teacher_prompt_ids) if sub.teacher_prompt_ids is not None else None
    for j, i in enumerate(idx):
        if i in places:
            prompts[j], responses[j] = prompts[j][-1:], responses[j][:1]
            if teacher is not None:
                teacher[j] = None
    sub = SequenceBatch(prompts, responses, teacher, dict(sub.tensors))
    trained = torch.tensor([i not in places for i in idx], dtype=torch.bool)
    T = sub.max_response_len
    tensors = {}
    for name, v in sub.tensors.items():
        v = v[:, :T] if v.ndim >= 2 else v
        if name in loss_fn.mask_keys and places:
            keep_rows = trained.to(v.device).reshape((-1,) + (1,) * (v.ndim - 1))
            v = torch.where(keep_rows, v, torch.zeros((), dtype=v.dtype, device=v.device))
        tensors[name] = v
    sub.tensors = tensors
    return Selection(sub, trained, keep, len(batch), loss_fn.global_normalizer(batch.tensors))


class PresetNormalizer:
    """`inner` with the loss normalizer fixed to the whole mini-batch's, and its token-mean
    metrics rescaled to the trained rows' tokens (module docstring).

    trained: `inner.global_normalizer` of the trained rows (scalar, or [2] for the hybrid:
    metrics named "sdpo/..." read its second entry, the others its first)."""

    def __init__(self, inner: LossFn, normalizer: torch.Tensor, trained: torch.Tensor) -> None:
        self.inner = inner
        self.requires = inner.requires
        self.distillation = inner.distillation
        self.on_policy = inner.on_policy
        self.normalizer = normalizer
        full = normalizer.reshape(-1).to(torch.float32)
        part = trained.reshape(-1).to(torch.float32)
        self._scale = (full / part.clamp_min(1.0)).tolist()
        self._empty = (part == 0).tolist()

    @property
    def mask_keys(self) -> tuple[str, ...]:
        return tuple(self.inner.mask_keys)

    def global_normalizer(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.normalizer

    def signal_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner.signal_rows(tensors)

    def _term(self, name: str) -> int | None:
        """Which normalizer entry a rescaled metric reads; None: the metric is left as it is."""
        if "loss" in name or not name.startswith(("grpo/", "sdpo/")):
            return None
        return 1 if name.startswith("sdpo/") and len(self._scale) == 2 else 0

    def __call__(self, outputs, tensors, normalizer):
        loss, metrics = self.inner(outputs, tensors, normalizer)
        out = {}
        for name, value in metrics.items():
            term = self._term(name)
            if term is None:
                out[name] = value
            elif not self._empty[term]:
                out[name] = value if name.endswith(("_max", "_min")) else value * self._scale[term]
        return loss, out


def dropped_metrics(metrics: dict[str, float], *, trained_rows: int) -> dict[str, float]:
    """`metrics` without the refit guard's numbers when no row was trained (placeholders only:
    the guard measured nothing)."""
    if trained_rows:
        return metrics
    return {k: v for k, v in metrics.items() if not k.startswith("refit/")}
