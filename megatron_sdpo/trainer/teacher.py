"""SDPO's teacher inside a step: the privileged contexts (a successful sibling, the
environment's feedback) the teacher is re-prompted with, the distillation mask and its
safeguards, and the diagnostics of the teacher's signal. The trainer calls it only for an
algorithm whose spec uses a teacher."""

from __future__ import annotations

import functools
import random
from typing import Any

import torch

from megatron_sdpo.algorithms.context import (
    build_teacher_contexts,
    teacher_feedbacks,
    templates_for,
    truncate_context_ids,
)
from megatron_sdpo.algorithms.safeguards import agreement_mask, contrast_weights
from megatron_sdpo.algorithms.sdpo import distill_mask, random_token_keep
from megatron_sdpo.chat import encode_prompts
from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.diagnostics.artifacts import ONCE_TOKENS
from megatron_sdpo.diagnostics.token_artifacts import artifact_endorsement, format_repeat_mask, mask_tensor
from megatron_sdpo.interfaces.backend import Backend, SequenceBatch
from megatron_sdpo.rewards.result import RewardResult


class SelfTeacher:
    """The student re-prompted with privileged context, as its own teacher, for one config."""

    def __init__(self, cfg: RunConfig, backend: Backend, tokenizer: Any):
        self.cfg = cfg
        self.backend = backend
        self.tokenizer = tokenizer
        mask_key = algorithm_spec(cfg.algorithm.name).distill_mask_key
        assert mask_key is not None, f"{cfg.algorithm.name} has a teacher but its spec names no mask"
        self.mask_key = mask_key

    @functools.cached_property
    def reasoning_end_ids(self) -> list[int] | None:
        """The token ids of `algorithm.sdpo.reasoning_end` (None: the config sets none)."""
        end = self.cfg.algorithm.sdpo.reasoning_end
        return self.tokenizer(end, add_special_tokens=False)["input_ids"] if end else None

    def signal(self, batch: SequenceBatch, rewards: torch.Tensor) -> dict[str, float]:
        """Whether the teacher's signal points the right way: per distilled response, the mean
        per-token log-probability gain of the teacher (with its context) over the student that
        sampled it (rollout logprobs), averaged over rewarded (score >= 1) and unrewarded
        responses. SDPO only pulls towards correct answers when `teacher/gain_gap` =
        gain_rewarded - gain_unrewarded is clearly positive."""
        mask = batch.tensors[self.mask_key]
        teacher = self.backend.logprobs(batch, model="teacher")
        tokens = mask.sum(1)
        gain = ((teacher - batch.tensors["rollout_logprobs"]) * mask).sum(1) / tokens.clamp_min(1.0)
        distilled = tokens > 0
        out = {}
        for name, sel in (("rewarded", distilled & (rewards >= 1.0)), ("unrewarded", distilled & (rewards < 1.0))):
            if bool(sel.any()):
                out[f"teacher/gain_{name}"] = float(gain[sel].mean())
        if len(out) == 2:
            out["teacher/gain_gap"] = out["teacher/gain_rewarded"] - out["teacher/gain_unrewarded"]
        # Where GRPO has no signal (every sample of the group rewarded) SDPO still distils: the
        # sampled-token estimate of KL(student || teacher) on those groups' tokens with a
        # context, whatever a safeguard left of the mask.
        n = self.cfg.algorithm.group_size
        has = torch.tensor([t is not None for t in (batch.teacher_prompt_ids or [None] * len(batch))])
        solved = (
            (rewards.view(-1, n) >= 1.0).all(dim=1).repeat_interleave(n)
            if len(rewards) % n == 0
            else torch.zeros_like(has)
        )
        sel = batch.response_mask() * (solved & has).to(torch.float32)[:, None]
        if bool(sel.any()):
            out["teacher/kl_all_success"] = float(
                ((batch.tensors["rollout_logprobs"] - teacher) * sel).sum() / sel.sum()
            )
        out.update(self._artifact_endorsement(batch, teacher - batch.tensors["rollout_logprobs"], mask > 0))
        return out

    def _artifact_endorsement(
        self, batch: SequenceBatch, gain: torch.Tensor, distilled: torch.Tensor
    ) -> dict[str, float]:
        """The teacher's endorsement of artifact tokens (a format marker that a well-formed answer
        holds once, repeated: `format_repeat_mask`): its mean log-prob gain over the student on
        those tokens (`teacher/artifact_gain`) minus its mean gain on the other distilled tokens
        (`teacher/artifact_endorsement`; > 0: distillation raises the artifact more than the rest,
        the amplification loop the paper reports). Nothing when a batch has no artifact token."""
        masks = []
        for ids in batch.response_ids:
            text = self.tokenizer.decode(ids)
            repeated = [tok for tok in ONCE_TOKENS if text.count(tok) > 1]
            if not repeated:  # token by token only where the whole response repeats a marker
                masks.append([False] * len(ids))
                continue
            pieces = [self.tokenizer.decode([t]) for t in ids]
            per_token = [format_repeat_mask(pieces, tok) for tok in repeated]
            masks.append([any(flags) for flags in zip(*per_token, strict=True)])
        rows, width = distilled.shape
        artifact = mask_tensor(masks, (rows, width)).to(distilled.device)
        e = artifact_endorsement(gain, artifact, distilled.float())
        if not (e["artifact_tokens"] and e["other_tokens"]):
            return {}
        return {
            "teacher/artifact_tokens": e["artifact_tokens"],
            "teacher/artifact_gain": e["artifact_logprob"],
            "teacher/artifact_endorsement": e["logprob_gap"],
        }

    def attach(
        self,
        batch: SequenceBatch,
        records: list[dict],
        texts: list[str],
        rewards: torch.Tensor,
        results: list[RewardResult],
        seed: int,
        *,
        domain: str,
        truncated: list[bool] | None = None,
    ) -> tuple[list[bool], dict[str, float]]:
        """Teacher prompts (successful sibling and/or feedback) and the distillation mask, its
        safeguards applied: (which samples have a context, the safeguards' metrics); `truncated`
        marks responses cut at max_new_tokens (None: none was)."""
        s = self.cfg.algorithm.sdpo
        templates = templates_for(s.context, domain)
        cut = truncated if truncated is not None else [False] * len(results)
        feedbacks = teacher_feedbacks(s.context, domain, results, cut)
        contexts = build_teacher_contexts(
            [r["prompt"] for r in records],
            texts,
            rewards.tolist(),
            feedbacks,
            group_size=self.cfg.algorithm.group_size,
            templates=templates,
            rng=random.Random(seed) if s.context.sibling == "random" else None,
        )
        encoded = [
            truncate_context_ids(ids, s.context.max_context_tokens, s.context.truncation)
            for ids in encode_prompts(
                self.tokenizer,
                [ctx for ctx in contexts if ctx is not None],
                # The teacher sees the student's earlier turns too: only its last turn gains context.
                [rec.get("history", ()) for rec, ctx in zip(records, contexts, strict=True) if ctx is not None],
            )
        ]
        it = iter(encoded)
        batch.teacher_prompt_ids = [next(it) if ctx is not None else None for ctx in contexts]
        has = torch.tensor([ctx is not None for ctx in contexts], dtype=torch.float32)
        response_ids = torch.zeros(len(batch), batch.max_response_len, dtype=torch.long)
        for i, r in enumerate(batch.response_ids):
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask = distill_mask(
            response_ids,
            batch.tensors["loss_mask"],
            reasoning_end_ids=self.reasoning_end_ids,
            distill_cot=s.distill_cot,
        )
        # The paper code's random token masking of the distillation loss (an ablation of its
        # density); mask_ratio 0 leaves the mask as it is.
        keep = random_token_keep(tuple(mask.shape), s.mask_ratio, seed)
        batch.tensors[self.mask_key] = mask * has[:, None] * keep
        return [bool(h) for h in has], self._safeguard(batch, rewards, has)

    def _safeguard(self, batch: SequenceBatch, rewards: torch.Tensor, has: torch.Tensor) -> dict[str, float]:
        """The distillation mask's safeguards (algorithms/safeguards.py), where configured; their
        metrics go to the step's (`sdpo/gate_mean` over samples with a context, `sdpo/agree_frac`
        of the tokens the mask held before)."""
        s, n, key = self.cfg.algorithm.sdpo, self.cfg.algorithm.group_size, self.mask_key
        metrics: dict[str, float] = {}
        if s.contrast_gate is not None:
            w = contrast_weights(rewards, group_size=n, s0=s.contrast_gate)
            batch.tensors[key] = batch.tensors[key] * w[:, None]
            if bool(has.any()):
                metrics["sdpo/gate_mean"] = float(w[has > 0].mean())
        if s.agreement_mask:
            before = batch.tensors[key]
            teacher = self.backend.logprobs(batch, model="teacher")
            agree = agreement_mask(teacher, batch.tensors["rollout_logprobs"], rewards, group_size=n)
            batch.tensors[key] = before * agree
            held = float((before != 0).sum())
            if held:
                metrics["sdpo/agree_frac"] = float((batch.tensors[key] != 0).sum()) / held
        return metrics
