"""The backend seam: everything the algorithm code needs from a training engine.

A backend owns a policy and a teacher (two weight sets with the same layout), an optimizer for
the policy, and the parallel layout. Algorithm code never touches parallelism: it hands the
backend a `SequenceBatch` and a `LossFn`; the backend splits it into micro-batches, computes
what the loss declares it needs, and owns every normalization factor (micro-batch count, DP
averaging) so that a loss written as `sum(per_token) / normalizer` gives the same gradient
whatever the number of ranks or micro-batches.

Layout convention: prompts are left-padded to a common length P and responses right-padded
to a common length T, so response token j of every sample sits at column P + j and its
logits come from column P + j - 1. Teacher prompts are padded to their own length P'; the
response columns then line up token for token between student and teacher.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from megatron_sdpo.interfaces.blend import TeacherBlend
from megatron_sdpo.interfaces.distillation import DistillationSpec, TopkSource
from megatron_sdpo.interfaces.schedule import LRSchedule

# Quantities a loss can ask for; each is aligned to response tokens: shape [B, T] or [B, T, V].
REQUIRES = frozenset(
    {
        "logprobs",  # [B, T] fp32 log pi(y_t | x, y_<t) of the policy
        "entropy",  # [B, T] fp32 entropy of the policy's next-token distribution
        "logits",  # [B, T, V] policy logits (full vocabulary; small models / top-k path)
        "teacher_logits",  # [B, T, V] teacher logits on the teacher prompt (no grad)
        "teacher_logprobs",  # [B, T] teacher log q(y_t | x, c, y_<t) (no grad)
        "ref_logprobs",  # [B, T] reference (base) model logprobs (no grad)
        "fused_kl",  # [B, T] per-token KL/JSD from the fused linear kernel (hidden states)
        "topk_logprobs",  # [B, T, k] full-vocab logprobs of the student's top-k ids (k = distillation.topk)
        "teacher_topk_logprobs",  # [B, T, k] teacher logprobs of the same ids (no grad)
    }
)


@dataclass
class SequenceBatch:
    """One global batch of prompt/response pairs (token ids, unpadded lists).

    prompt_ids[i]: the student prompt of sample i (chat template applied).
    response_ids[i]: the sampled response tokens of sample i.
    teacher_prompt_ids[i]: the teacher (re-)prompt, or None when sample i has no teacher context.
    tensors: extra per-sample or per-token tensors the loss reads, already response-aligned:
        e.g. "advantages" [B], "old_logprobs" [B, T], "rollout_logprobs" [B, T],
        "loss_mask" [B, T] (1 where the token's loss counts).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    teacher_prompt_ids: list[list[int] | None] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_response_len(self) -> int:
        return max((len(r) for r in self.response_ids), default=0)

    def response_mask(self) -> torch.Tensor:
        """[B, T] float32, 1 on real response tokens."""
        T = self.max_response_len
        m = torch.zeros(len(self), T, dtype=torch.float32)
        for i, r in enumerate(self.response_ids):
            m[i, : len(r)] = 1.0
        return m

    def teacher_prompts(self) -> list[list[int]]:
        """The prompt each sample is scored on by the teacher: its teacher prompt, or its student
        prompt where it has no teacher context (its distillation mask is 0 there; this only keeps
        the batch rectangular)."""
        tp = self.teacher_prompt_ids or [None] * len(self)
        return [t if t is not None else p for t, p in zip(tp, self.prompt_ids, strict=True)]

    def checked(self) -> SequenceBatch:
        """This batch with "response_mask" [B, T] added (if absent), after checking that every
        tensor has B rows and every per-token tensor the global T columns (DataError if not)."""
        from megatron_sdpo.errors import DataError

        T = self.max_response_len
        tensors = dict(self.tensors)
        tensors.setdefault("response_mask", self.response_mask())
        for k, v in tensors.items():
            if v.shape[0] != len(self):
                raise DataError(f"tensor {k!r} has {v.shape[0]} rows for a batch of {len(self)}")
            if v.ndim >= 2 and v.shape[1] != T:
                raise DataError(f"tensor {k!r} has {v.shape[1]} columns; the batch's longest response has {T}")
        return SequenceBatch(self.prompt_ids, self.response_ids, self.teacher_prompt_ids, tensors)

    def select(self, idx: list[int]) -> SequenceBatch:
        """Sub-batch with samples `idx`; per-token tensors keep the global T so shapes agree."""
        sub = {}
        for k, v in self.tensors.items():
            sub[k] = v[idx]
        return SequenceBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            response_ids=[self.response_ids[i] for i in idx],
            teacher_prompt_ids=None if self.teacher_prompt_ids is None else [self.teacher_prompt_ids[i] for i in idx],
            tensors=sub,
        )


@runtime_checkable
class LossFn(Protocol):
    """A loss over one micro-batch.

    `requires` names the model outputs it needs (a subset of REQUIRES).
    `__call__(outputs, tensors, normalizer)` returns (loss, metrics) where loss is the
    micro-batch's *share* of the global loss: sum over its tokens / normalizer. The backend
    picks `normalizer` globally (e.g. the number of loss tokens in the whole global batch on all
    DP ranks) via `global_normalizer(batch)` and multiplies by the DP size where its gradient
    reduction averages. Metrics are detached scalars (sums over the micro-batch, reduced by the
    backend with `metric_reduce`).

    `distillation` is what the backend must compute for a distilling loss (alpha, temperature,
    top-k and its source, mask key, fused kernel or not): the one place a backend reads those
    settings; None for a loss that does not distill. `on_policy` is True when the loss takes the
    current policy's detached log-probabilities as the behaviour policy, which holds only for
    one optimizer step per batch (`trainer.minibatch_update` refuses it with several).
    `signal_rows` and `mask_keys` let the trainer skip rows without signal exactly.
    """

    requires: frozenset
    on_policy: bool

    @property
    def distillation(self) -> DistillationSpec | None: ...  # read-only: a loss may narrow it

    def global_normalizer(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @property
    def mask_keys(self) -> tuple[str, ...]:
        """The tensors ([B, T] masks or token weights, [B] row weights) whose 0 drops a token or
        row from the loss and every metric: zeroing them all makes a row contribute nothing."""
        ...

    def signal_rows(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] bool: False where the row's contribution to the gradient is exactly 0 whatever the
        model outputs (algorithms/signal_rows.py leaves those rows out of the forward and backward)."""
        ...

    def __call__(
        self,
        outputs: dict[str, torch.Tensor],
        tensors: dict[str, torch.Tensor],
        normalizer: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class Backend(Protocol):
    """Training engine seam (HF transformers + torch DDP, or megatron-core). Backends subclass
    it to declare conformance; a conformance test checks that each defines every member itself.

    `topk_source` is a capability: where this backend picks the student's top-k ids for top-k
    distillation ("logits": it can hand the loss [B, T, V] logits and the loss picks them;
    "shards": its logits stay vocab-sharded, so it computes "topk_logprobs" itself). The loss is
    built for it (`algorithms.registry.build_loss`). `device` is where its policy lives (step
    timers synchronize it when it is a CUDA device). `dp_size` is the number of data-parallel ranks a
    batch is split over."""

    topk_source: TopkSource
    device: torch.device
    # Data-parallel ranks a batch is split over: a skipped step keeps this many rows
    # (algorithms/signal_rows.py) so that every rank runs the step's collectives.
    dp_size: int

    def logprobs(self, batch: SequenceBatch, *, model: str = "policy") -> torch.Tensor:
        """[B, T] fp32 per-token logprobs of `batch.response_ids` under `model`
        ("policy" | "teacher" | "reference"); the teacher reads `teacher_prompt_ids` where given."""

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the global batch; returns reduced metrics incl. grad_norm."""

    def export_weights(self, *, model: str = "policy") -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (HF name, full tensor) pairs, gathered across TP/PP, one tensor at a time."""

    def blend_teacher(self, blend: TeacherBlend) -> None:
        """Apply a teacher update (interfaces/blend.py) to the teacher's local shards: its fp32
        truth becomes the blend of the policy's fp32 truth, itself and the base model."""

    def configure_optimizer(self, *, lr: float, weight_decay: float, grad_clip: float, lr_schedule: LRSchedule) -> None:
        """A stage's optimizer settings; they take effect at the next `set_lr_schedule` / step."""

    def reset_optimizer(self) -> None:
        """Fresh optimizer state (used at stage boundaries)."""

    def offload_training_state(self) -> int:
        """Move what only the optimizer step reads (gradients, optimizer state) off the device
        while the rollout engine is awake; returns the bytes freed. Every method that needs it
        brings it back first (`reload_training_state`)."""

    def reload_training_state(self) -> None:
        """Undo `offload_training_state` (nothing to do when it is not offloaded)."""

    def set_lr_schedule(self, total_steps: int | None) -> None:
        """Restart the learning-rate schedule (interfaces/schedule.py) at step 0 of a stage of
        `total_steps` optimizer steps (None: hold the peak lr)."""

    def save(self, path: str, *, extra: dict | None = None) -> None:
        """Save policy, teacher, optimizer, scheduler and RNG (atomically)."""

    def load(self, path: str, *, weights_only: bool = False) -> dict:
        """Load a checkpoint written by `save`; returns the `extra` dict saved with it."""
