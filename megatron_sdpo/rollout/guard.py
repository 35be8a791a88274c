"""Refit guard: does the rollout engine sample from the policy the trainer holds?

Every step the trainer's log-probabilities of the sampled tokens (computed by the loss's own
forward pass, before the optimizer step, so with the weights the engine was refitted with) are
compared with the engine's sampling logprobs over the response tokens:
- `refit/logprob_diff_mean`, `refit/logprob_diff_max`: mean and max of |Δ| = |trainer - rollout|;
- `refit/token_mult_prob_error`: token mean of exp(|Δ|) (NeMo-RL's token_mult_prob_error; 1 is
  a perfect match);
- `refit/seq_prob_ratio_mean`: mean over sequences of exp(Σ_t Δ), the ratio of the sequence's
  probability under the trainer to the engine's (1 is a perfect match; Σ capped at 80 so a
  broken refit logs a huge finite number rather than inf).
Above `rollout.guard.max_mismatch` (on the mean |Δ|) the run stops with one line naming the
step and, from per-tensor checksums of what the trainer sent against what the engine's worker
received at the last refit, the first tensor that differs. A checksum difference alone stops
the run too: in-process the bytes cannot legitimately change on the way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sdpo.errors import RefitError
from megatron_sdpo.interfaces.backend import LossFn
from megatron_sdpo.interfaces.distillation import DistillationSpec

TOKEN_WEIGHT = "guard_token_weight"  # [B, T] response mask / global response-token count
SEQ_WEIGHT = "guard_seq_weight"  # [B] 1 / global batch size
_SUM_CAP = 80.0


def attach_guard_tensors(
    tensors: dict[str, torch.Tensor], response_mask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Adds the per-token and per-sequence weights that make the guard metrics shares of
    global means (the backends sum metric shares over micro-batches and ranks).
    response_mask: [B, T] 1 on response tokens; rows: [B] bool, the rows measured (None: all)."""
    mask = response_mask.to(torch.float32)
    seq = torch.ones(mask.shape[0], dtype=torch.float32, device=mask.device)
    if rows is not None:
        seq = rows.to(device=mask.device, dtype=torch.float32)
        mask = mask * seq[:, None]
    tensors[TOKEN_WEIGHT] = mask / mask.sum().clamp_min(1.0)
    tensors[SEQ_WEIGHT] = seq / seq.sum().clamp_min(1.0)


def mismatch_metrics(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    token_weight: torch.Tensor,
    seq_weight: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Shares of the guard metrics for one micro-batch (fp32).

    trainer_logprobs, rollout_logprobs, token_weight: [b, T]; seq_weight: [b]. Tokens with
    token_weight 0 are ignored. Names ending in `_max` reduce by max, the others by sum."""
    mask = token_weight > 0
    diff = (trainer_logprobs.detach().float() - rollout_logprobs.float()) * mask
    absd = diff.abs()
    w = token_weight.float()
    seq_sum = diff.sum(dim=1).clamp(max=_SUM_CAP)
    return {
        "refit/logprob_diff_mean": (absd * w).sum(),
        "refit/logprob_diff_max": absd.amax() if absd.numel() else absd.new_zeros(()),
        "refit/token_mult_prob_error": (torch.exp(absd) * w).sum(),
        "refit/seq_prob_ratio_mean": (torch.exp(seq_sum) * seq_weight.float()).sum(),
    }


class GuardedLoss:
    """Wraps a LossFn: the same loss, plus the guard metrics from the "logprobs" output (added
    to `requires`; every shipped loss but SDPO without importance weights needs it anyway, so
    no extra forward pass). The rest of the `LossFn` protocol (`distillation`, `on_policy`) is
    the wrapped loss's, forwarded explicitly."""

    def __init__(self, inner: LossFn) -> None:
        self.inner = inner
        self.requires = frozenset(inner.requires) | {"logprobs"}
        self.distillation: DistillationSpec | None = inner.distillation
        self.on_policy: bool = inner.on_policy

    @property
    def mask_keys(self) -> tuple[str, ...]:
        # The guard's weights too: a row kept only to run the step (algorithms/signal_rows.py) adds
        # nothing to its metrics.
        return tuple(self.inner.mask_keys) + (TOKEN_WEIGHT, SEQ_WEIGHT)

    def global_normalizer(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner.global_normalizer(tensors)

    def signal_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner.signal_rows(tensors)

    def __call__(self, outputs, tensors, normalizer):
        loss, metrics = self.inner(outputs, tensors, normalizer)
        metrics = dict(metrics)
        metrics.update(
            mismatch_metrics(
                outputs["logprobs"], tensors["rollout_logprobs"], tensors[TOKEN_WEIGHT], tensors[SEQ_WEIGHT]
            )
        )
        return loss, metrics


def first_changed(sent: dict[str, tuple[float, float]], received: dict[str, tuple[float, float]]) -> str | None:
    """The first tensor (in sending order) whose checksum differs from what arrived, or that
    never arrived; None when all match. Checksums are of the same bytes on the same device, so
    they must match exactly."""
    for name, value in sent.items():
        if received.get(name) != value:
            return name
    return None


def _any_rank(name: str | None) -> str | None:
    """The first rank's non-None answer, on every rank (ranks must agree to stop together)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return name
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, name)
    return next((n for n in names if n is not None), None)


class RefitGuard:
    """Checks one step's guard metrics and the last refit's checksums; raises RefitError."""

    def __init__(self, max_mismatch: float | None) -> None:
        self.max_mismatch = max_mismatch

    def check(self, step_label: str, metrics: dict[str, float], engine) -> None:
        """step_label names the step in the error ("stage 1 step 3"). engine: the rollout engine;
        its `sent_checksums` / `received_checksums` ({} on engines that keep weights in process)
        are those of its last refit, whose weights produced this step's samples."""
        sent, received = engine.sent_checksums, engine.received_checksums
        changed = _any_rank(first_changed(sent, received))
        mean = metrics.get("refit/logprob_diff_mean")
        over = self.max_mismatch is not None and mean is not None and not mean <= self.max_mismatch
        if changed is None and not over:
            return
        what = (
            f"mean |Δ logprob| {mean:.4g} > rollout.guard.max_mismatch {self.max_mismatch:g}"
            if over
            else "a refit tensor changed on the way"
        )
        if changed is not None:
            where = f"first tensor that differs between what the trainer sent and what the engine received: {changed}"
        elif sent:
            where = f"all {len(sent)} refit tensors arrived intact (suspect the engine's weight loading or numerics)"
        else:
            where = "no refit has happened yet (the engine holds the weights it loaded from disk)"
        raise RefitError(f"refit guard at {step_label}: {what}; {where}")
