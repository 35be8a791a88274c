"""Several optimizer steps per rollout batch (PPO/GRPO mini-batches): the pure parts.

The trainer (`trainer.minibatch_update`) drives the backend through them. The rollout batch is
split into `n` mini-batches of whole prompt groups, in order; each is one
optimizer step through the backend. The old log-probabilities are those of the policy that
sampled the batch, computed once before the first update, so from the second mini-batch on the
importance ratio differs from 1 and the clip acts (the paper's GRPO baseline: 32 prompts per
rollout in mini-batches of 8, 4 optimizer steps).
"""

from __future__ import annotations

from megatron_sdpo.algorithms.losses import metric_reduce
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import SequenceBatch

# Backend step results that are counts over the mini-batches rather than per-step means.
_COUNTS = ("skipped", "samples", "train/rows_skipped")


def split_groups(batch: SequenceBatch, n: int, group_size: int) -> list[SequenceBatch]:
    """`batch` (samples of a prompt consecutive, `group_size` each) cut into `n` mini-batches
    of whole groups, in order; per-token tensors cut to each mini-batch's longest response."""
    if n < 1:
        raise ConfigError(f"mini_batches must be >= 1, got {n}")
    if len(batch) % group_size:
        raise ValueError(f"{len(batch)} samples do not split into groups of {group_size}")
    groups = len(batch) // group_size
    if groups % n:
        raise ConfigError(f"{groups} prompts per step do not split into {n} mini-batches")
    size = len(batch) // n
    out = []
    for k in range(n):
        sub = batch.select(list(range(k * size, (k + 1) * size)))
        # Per-token tensors ([B, T, ...]) are cut to the mini-batch's longest response.
        T = sub.max_response_len
        sub.tensors = {name: v[:, :T] if v.ndim >= 2 else v for name, v in sub.tensors.items()}
        out.append(sub)
    return out


def combine_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict for the optimizer steps of a rollout batch: the mean of per-step means,
    the max / min of `_max` / `_min` metrics, sums of counts, the last lr; plus
    "optimizer_steps"."""
    out: dict[str, float] = {}
    # A step can lack a metric another reports (a term with no trained row: algorithms/signal_rows.py).
    for name in dict.fromkeys(n for s in steps for n in s):
        vals = [s[name] for s in steps if name in s]
        if name == "lr":
            out[name] = vals[-1]
        elif name in _COUNTS or name.startswith("time/"):  # seconds add up over the steps
            out[name] = float(sum(vals))
        elif metric_reduce(name) == "max":
            out[name] = max(vals)
        elif metric_reduce(name) == "min":
            out[name] = min(vals)
        else:
            out[name] = sum(vals) / len(vals)
    out["optimizer_steps"] = float(len(steps))
    return out
