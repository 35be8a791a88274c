"""The loss side of one Megatron train step.

Per micro-batch, the pipeline schedule hands the last stage the model's output (vocab-sharded
logits, or final hidden states on the fused path) and the riders' (teacher, reference); this
turns them into what the loss declared it needs (`LossFn.requires`), runs the loss and keeps
its metric shares for the step's reduction. The loss's distillation spec is read once per step.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatron_sdpo.backends import vocab_parallel as vp
from megatron_sdpo.backends.common import MetricSums
from megatron_sdpo.backends.megatron import heads
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import LossFn
from megatron_sdpo.interfaces.distillation import DistillationSpec, distillation_of

_POLICY_OUTPUTS = frozenset({"logprobs", "entropy", "logits"})
_TOPK = frozenset({"topk_logprobs", "teacher_topk_logprobs"})
# Outputs over the whole vocabulary that the loss reads as such: no chunking over tokens.
_WHOLE = frozenset({"logits", "teacher_logits"})


def step_distillation(loss_fn: LossFn, requires: frozenset) -> DistillationSpec | None:
    """The distillation spec the step's outputs need (ConfigError when the loss lacks it)."""
    spec = None
    if "fused_kl" in requires:
        spec = distillation_of(loss_fn, "fused_kl")
    if requires & _TOPK:
        spec = distillation_of(loss_fn, "topk_logprobs")
    return spec


class StepLoss:
    """Loss inputs from one micro-batch's outputs, the loss, and the step's metric sums.

    `be` is the MegatronBackend (its vocabulary shard, TP group, layout and heads); `riders` its
    (name, model, prompts) list for the step; `scale` undoes the schedule's division by the
    micro-batch count and DDP's average over data parallel."""

    def __init__(
        self, be, loss_fn: LossFn, requires: frozenset, riders: list, normalizer: torch.Tensor, *, scale: float
    ):
        self.be, self.loss_fn, self.requires, self.riders = be, loss_fn, requires, riders
        self.normalizer, self.scale = normalizer, scale
        self.distill = step_distillation(loss_fn, requires)
        self.sums = MetricSums()

    def spec(self) -> DistillationSpec:
        """The distillation spec, for outputs only a distilling loss asks for."""
        if self.distill is None:
            raise ConfigError("this step's outputs need the loss's distillation spec")
        return self.distill

    def finish(self, mb: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
        loss, metrics = self.loss_fn(outputs, mb["tensors"], self.normalizer)
        self.sums.add_all(loss, metrics)
        return loss * self.scale, {}

    def from_logits(self, mb: dict, rider_logits: list, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The loss of a micro-batch from vocab-sharded logits (policy and riders).

        The per-token statistics run over `be.loss_chunk_tokens` response tokens at a time, each
        chunk recomputed in backward (activation checkpointing): the fp32 [tokens, V/tp] tensors
        they build are alive for one chunk, not for the whole micro-batch through the backward.
        Losses that read whole-vocabulary logits ("logits", "teacher_logits") take them whole."""
        be, rows = self.be, mb["rows"]
        b, T = rows.targets.shape
        # 16-bit [b, T, width] at the response columns, padding cut off: one gather per model,
        # so the policy's backward scatters into its logits once.
        shards = [
            r.select(lg)[..., : be.vocab_width]
            for r, lg in zip((rows, *mb["rider_rows"]), (logits, *rider_logits), strict=True)
        ]
        targets = [rows.targets, *(r.targets for r in mb["rider_rows"])]
        chunk = be.loss_chunk_tokens
        if not chunk or b * T <= chunk or self.requires & _WHOLE:
            return self.finish(mb, self.token_outputs(shards, targets))
        pieces = [torch.split(x.reshape(b * T, *x.shape[2:]), chunk) for x in (*shards, *targets)]
        n = len(shards)
        keys: list[str] = []

        def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.token_outputs(list(args[:n]), list(args[n:]))
            keys[:] = sorted(out)
            return tuple(out[k] for k in keys)

        parts = [checkpoint(run, *args, use_reentrant=False) for args in zip(*pieces, strict=True)]
        outputs = {k: torch.cat([p[i] for p in parts]).view(b, T, *parts[0][i].shape[1:]) for i, k in enumerate(keys)}
        return self.finish(mb, outputs)

    def token_outputs(self, shards: list[torch.Tensor], targets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the loss requires, per response token, from 16-bit logit shards [..., width] of
        the policy and each rider (in `riders` order) and each one's target ids [...]."""
        be, requires = self.be, self.requires
        shard = be.fp32_logits(shards[0])
        outputs = be._stats(shard, targets[0], requires & _POLICY_OUTPUTS)
        for (name, _, _), tgt, lg in zip(self.riders, targets[1:], shards[1:], strict=True):
            rshard = be.fp32_logits(lg)
            if name == "reference":
                outputs["ref_logprobs"] = vp.logprobs(rshard, tgt, be.vocab_start, be.tp_group)[0]
                continue
            if "teacher_logprobs" in requires:
                outputs["teacher_logprobs"] = vp.logprobs(rshard, tgt, be.vocab_start, be.tp_group)[0]
            if "teacher_logits" in requires:
                if be.layout.tp > 1:
                    raise ConfigError("'teacher_logits' needs tp == 1 (logits stay vocab-sharded); use 'fused_kl'")
                outputs["teacher_logits"] = rshard
            if "fused_kl" in requires:
                d = self.spec()
                outputs["fused_kl"] = vp.generalized_jsd(
                    vp.tempered(shard, d.temperature), vp.tempered(rshard, d.temperature), d.alpha, be.tp_group
                )
            if requires & _TOPK:
                d = self.spec()
                if d.topk is None:
                    raise ConfigError("'topk_logprobs' needs a distillation spec with a top-k")
                outputs["topk_logprobs"], outputs["teacher_topk_logprobs"], _ = vp.topk_logprobs(
                    vp.tempered(shard, d.temperature),
                    vp.tempered(rshard, d.temperature),
                    d.topk,
                    be.vocab_start,
                    be.spec.vocab_size,
                    be.tp_group,
                )
        return outputs

    def from_hidden(self, mb: dict, rider_hidden: list, hidden: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The loss of a micro-batch from final hidden states (`heads`): "fused_kl" through the
        fused KL kernel as the distillation spec says, logprobs / entropy through the fused
        logprob kernel."""
        be, requires, d, riders = self.be, self.requires, self.spec(), self.riders
        rows, sp = mb["rows"], be.options.sequence_parallel
        b, T = rows.targets.shape
        lp_args = dict(
            start=be.vocab_start,
            vocab=be.spec.vocab_size,
            tp_group=be.tp_group,
            impl=d.kernel_impl,
            temperature=be.logit_temperature,
        )
        h_s = heads.response_hidden(hidden, rows, be.tp_group, sp)
        w_s = heads.output_weight(be.policy, be.vocab_width)
        out: dict[str, torch.Tensor] = {}
        if requires & {"logprobs", "entropy"}:
            lp, ent = heads.token_logprobs(h_s, w_s, rows.targets, want_entropy="entropy" in requires, **lp_args)
            out["logprobs"] = lp
            if ent is not None:
                out["entropy"] = ent
        for (name, model, _), rrows, rh in zip(riders, mb["rider_rows"], rider_hidden, strict=True):
            with torch.no_grad():
                h_r = heads.response_hidden(rh, rrows, be.tp_group, sp)
                w_r = heads.output_weight(model, be.vocab_width)
                if name == "reference" or "teacher_logprobs" in requires:
                    key = "ref_logprobs" if name == "reference" else "teacher_logprobs"
                    out[key] = heads.token_logprobs(h_r, w_r, rrows.targets, **lp_args)[0]
            if name == "teacher":
                kl = heads.fused_kl(h_s, h_r, w_s, w_r, d, tp_group=be.tp_group, logit_temperature=be.logit_temperature)
                out["fused_kl"] = kl.view(b, T)
        return self.finish(mb, out)
