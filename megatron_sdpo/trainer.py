"""One on-policy RL step: rollout -> verify -> advantages / teacher contexts -> update -> sync.

The algorithm-specific parts are the loss object and the tensors it reads; everything else is
shared between GRPO, SDPO, StableSDPO and the hybrid.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_sdpo.algorithms.minibatch import combine_step_metrics, split_groups
from megatron_sdpo.algorithms.signal import PresetNormalizer, dropped_metrics, select_signal_rows
from megatron_sdpo.chat import encode_prompts, record_prompts
from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import Backend, LossFn, SequenceBatch
from megatron_sdpo.interfaces.distillation import TopkSource
from megatron_sdpo.rollout.base import SamplingConfig
from megatron_sdpo.rollout.guard import attach_guard_tensors
from megatron_sdpo.stopwatch import PhaseTimes


def extra_round_seed(seed: int, round_: int) -> int:
    """The sampling seed of generation round `round_` of a step whose first round has `seed`."""
    return seed if round_ == 0 else (seed + 7919 * round_) % (2**31 - 1)


def pad_2d(rows: list[list[float]], width: int, value: float = 0.0) -> torch.Tensor:
    """[B, width] fp32 tensor from ragged rows, right-padded with `value`."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


def build_loss(cfg: RunConfig, *, topk_source: TopkSource):
    """The LossFn for the configured algorithm (see megatron_sdpo.algorithms.losses), for a
    backend whose capability `topk_source` ("logits" or "shards", `Backend.topk_source`) says
    where it picks the student's top-k ids."""
    from megatron_sdpo.algorithms import losses

    a = cfg.algorithm
    spec = algorithm_spec(a.name)
    g = a.grpo
    # One optimizer step per rollout batch: the behaviour policy is the current one (detached);
    # with mini-batches the old log-probs are the rollout-time policy's (minibatch_update).
    grpo = losses.GRPOLoss(
        clip_low=g.clip_low,
        clip_high=g.clip_high,
        kl_coef=g.kl_coef,
        tis_cap=g.tis_cap,
        on_policy=g.mini_batches == 1,
        dual_clip=g.dual_clip,
    )
    if not spec.uses_teacher:
        return grpo
    s = a.sdpo
    if spec.distill_mask_key is None:
        raise ConfigError(f"algorithm {a.name!r} uses a teacher but names no distillation mask")
    sdpo = losses.SDPOLoss(
        alpha=s.alpha,
        topk=s.topk,
        add_tail=s.add_tail,
        is_clip=s.is_clip,
        variant=s.variant,
        mask_key=spec.distill_mask_key,
        fused=cfg.kernel.fused_kl,
        kernel_impl=cfg.kernel.impl,
        chunk_tokens=cfg.kernel.chunk_tokens,
        chunk_vocab=cfg.kernel.chunk_vocab,
        # Only the logits top-k path has ids to pick.
        topk_source=topk_source if s.topk is not None and s.variant == "logits" else "logits",
    )
    if spec.uses_advantages:  # both terms: lam * GRPO + (1 - lam) * SDPO
        return losses.HybridLoss(sdpo=sdpo, grpo=grpo, lam=s.hybrid_lambda)
    return sdpo


def minibatch_update(
    backend: Backend, batch: SequenceBatch, loss_fn: LossFn, *, mini_batches: int, group_size: int, skip: bool = False
) -> dict[str, float]:
    """`mini_batches` optimizer steps on `batch` through `backend.train_step`. With more than one,
    "old_logprobs" [B, T] of the current (rollout-time) policy are added to the batch first and
    the loss must read them (GRPOLoss(on_policy=False)); where the batch carries the refit
    guard's weights, the guard's numbers are measured on them. With `skip`, rows without signal
    leave every forward and backward (algorithms/signal.py). Returns the combined metrics, with
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
    """One optimizer step on `batch`; with `skip` on its rows with signal only (signal.py)."""
    from megatron_sdpo.rollout.guard import TOKEN_WEIGHT, attach_guard_tensors

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
    from megatron_sdpo.rollout.guard import SEQ_WEIGHT, TOKEN_WEIGHT, attach_guard_tensors, mismatch_metrics

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


@dataclass
class StepOutput:
    metrics: dict
    responses: list[str]
    truncated: list[bool]
    token_lengths: list[int]
    has_context: list[bool]


class Trainer:
    """Runs RL steps for one policy through a backend and a rollout engine."""

    def __init__(self, cfg: RunConfig, backend, engine, tokenizer):
        self.cfg = cfg
        self.backend = backend
        self.engine = engine
        self.tokenizer = tokenizer
        from megatron_sdpo.rollout.guard import RefitGuard

        self.loss_fn = self._loss(cfg)
        self.guard = RefitGuard(cfg.rollout.guard.max_mismatch)
        self._reasoning_end_ids = (
            tokenizer(cfg.algorithm.sdpo.reasoning_end, add_special_tokens=False)["input_ids"]
            if cfg.algorithm.sdpo.reasoning_end
            else None
        )

    def _loss(self, cfg: RunConfig):
        """The configured loss, for this trainer's backend. With one optimizer step per rollout
        batch its own forward pass also measures how far the engine's logprobs are off
        (rollout/guard.py); with several, the guard reads the old log-probabilities computed
        before the first step instead (later steps see a policy that has already moved)."""
        from megatron_sdpo.rollout.guard import GuardedLoss

        loss = build_loss(cfg, topk_source=self.backend.topk_source)
        return GuardedLoss(loss) if cfg.algorithm.grpo.mini_batches == 1 else loss

    @property
    def algorithm(self):
        """The configured algorithm's spec (uses teacher / advantages, distillation mask)."""
        return algorithm_spec(self.cfg.algorithm.name)

    @property
    def uses_teacher(self) -> bool:
        return self.algorithm.uses_teacher

    def configure(self, cfg: RunConfig) -> None:
        """Run with `cfg` from now on (a stage's settings: config/stages.py)."""
        self.cfg = cfg
        self.loss_fn = self._loss(cfg)

    def step(
        self,
        domain: str,
        records: list[dict],
        *,
        seed: int,
        step: int = 0,
        label: str | None = None,
        after_train: Callable[[], None] | None = None,
        refill: Callable[[int], list[dict]] | None = None,
        between_phases: Callable[[tuple[str, ...]], None] | None = None,
    ) -> StepOutput:
        """One optimizer step on `records` (prompts_per_step records of one domain); `step`
        (0-based within the stage) schedules the periodic diagnostics; `label` names the step
        in a refit-guard error; `after_train` runs after the optimizer step while the engine
        still sleeps (the teacher update: its transients never share the device with vLLM);
        `refill(r)` gives the prompts of extra generation round r >= 1 when
        `algorithm.filter_groups` is on (rollout/group_filter.py; None: no extra round).
        `between_phases(left)` runs before the teacher and before the train phase with the
        phases still to come; it may raise StepAbandoned (stop_request.py): nothing the step
        changes is changed before the first optimizer step.

        Engine order: generate (awake) -> sleep (frees weights and KV cache while training) ->
        train -> wake the weights -> refit -> wake the KV cache -> next generate."""
        from megatron_sdpo.algorithms.grpo import group_advantages

        cfg, a = self.cfg, self.cfg.algorithm
        n = a.group_size
        times = PhaseTimes(self.backend.device)
        dynamic: dict[str, float] = {}
        if a.filter_groups.enabled:
            records, prompt_ids, comps, results, dynamic = self._filtered_rollout(domain, records, seed, times, refill)
        else:
            prompt_ids, comps, results = self._rollout(domain, records, seed, times, sleep=True)

        sample_records = [records[c.prompt_index] for c in comps]
        texts = [c.text for c in comps]
        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
        batch = SequenceBatch(
            prompt_ids=[prompt_ids[c.prompt_index] for c in comps],
            response_ids=[list(c.token_ids) for c in comps],
        )
        T = batch.max_response_len
        response_mask = batch.response_mask()
        batch.tensors["rollout_logprobs"] = pad_2d([c.logprobs for c in comps], T)
        batch.tensors["loss_mask"] = response_mask
        attach_guard_tensors(batch.tensors, response_mask)
        has_context = [False] * len(comps)
        if between_phases is not None:
            between_phases(("teacher", "train", "sync") if self.algorithm.uses_teacher else ("train", "sync"))
        if self.algorithm.uses_advantages:
            batch.tensors["advantages"] = group_advantages(rewards, group_size=n, norm_by_std=a.grpo.norm_by_std)
        signal: dict[str, float] = {}
        if self.algorithm.uses_teacher:
            with times.phase("teacher"):
                has_context, signal = self._attach_teacher(
                    batch,
                    sample_records,
                    texts,
                    rewards,
                    results,
                    seed,
                    domain=domain,
                    truncated=[c.truncated for c in comps],
                )
                every = cfg.diagnostics.teacher_signal_every if cfg.diagnostics.enabled else 0
                if every and step % every == 0:
                    signal.update(self._teacher_signal(batch, rewards))
            if between_phases is not None:
                between_phases(("train", "sync"))
        with times.phase("train"):
            train_metrics = self._update(batch)
            if after_train is not None:
                after_train()
            if cfg.backend.offload_training_state:
                # Off the device before the engine wakes; the next train step brings it back.
                self.backend.offload_training_state()
        # The backends run the teacher's forward inside their train step and report its time;
        # a train step without a teacher reports none.
        times.move(train_metrics.pop("time/teacher_forward", 0.0), source="train", target="teacher")

        # This step's samples came from the last refit's weights: check them before the next.
        self.guard.check(label or f"step {step + 1}", train_metrics, self.engine)
        with times.phase("sync"):
            # Weights first, then the KV cache: the refit's buckets never share the device with it.
            self.engine.wake(("weights",))
            self.engine.update_weights(self.backend.export_weights(model="policy"))
            self.engine.wake(("kv_cache",))
        sync_stats = dict(self.engine.last_sync)
        lengths = [len(c.token_ids) for c in comps]
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "solve_rate": float((rewards >= 1.0).float().mean()),
            "response_len": sum(lengths) / max(len(lengths), 1),
            "teacher_context_frac": sum(has_context) / max(len(has_context), 1),
            **sync_stats,
            **dynamic,
            **times.metrics(),
            **signal,
            **train_metrics,
        }
        return StepOutput(metrics, texts, [c.truncated for c in comps], lengths, has_context)

    def _rollout(self, domain: str, records: list[dict], seed: int, times: PhaseTimes, *, sleep: bool):
        """One generation round on `records` and its scoring: (prompt ids, completions, results);
        with `sleep` the engine sleeps as soon as it has generated."""
        from megatron_sdpo.rollout.scoring import score_shared

        cfg = self.cfg
        with times.phase("rollout"):
            prompt_ids = record_prompts(self.tokenizer, records)
            sampling = SamplingConfig(
                n=cfg.algorithm.group_size,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens,
                seed=seed,
            )
            comps = self.engine.generate(prompt_ids, sampling)
            if sleep:
                self.engine.sleep()
        with times.phase("reward"):
            results = score_shared(
                domain,
                [c.text for c in comps],
                [records[c.prompt_index] for c in comps],
                batched_code=cfg.rewards.batched_code,
            )
        return prompt_ids, comps, results

    def _filtered_rollout(self, domain, records, seed, times, refill):
        """DAPO's dynamic sampling (rollout/group_filter.py): rounds of generation until the step
        holds `prompts_per_step` groups with reward variance or the extra rounds run out; returns
        the chosen groups as (records, prompt ids, completions, results) and `dynamic/` metrics.
        Every rank scores every sample (score_shared), so all take the same number of rounds."""
        import dataclasses
        import time

        from megatron_sdpo.rollout.group_filter import Group, GroupPool, informative

        n, fg = self.cfg.algorithm.group_size, self.cfg.algorithm.filter_groups
        pool = GroupPool(want=len(records))
        extra_s = 0.0
        for r in range(fg.max_extra_rounds + 1):
            if r and (pool.full or refill is None):
                break
            start = time.perf_counter()
            recs = records if r == 0 else refill(r)
            ids, comps, results = self._rollout(domain, recs, extra_round_seed(seed, r), times, sleep=False)
            groups = []
            for j, (rec, p) in enumerate(zip(recs, ids, strict=True)):
                mine = comps[j * n : (j + 1) * n]
                if [c.prompt_index for c in mine] != [j] * n:
                    raise RuntimeError(f"the engine returned samples out of prompt order (prompt {j})")
                groups.append(Group(rec, p, mine, results[j * n : (j + 1) * n]))
            pool.add(groups, informative([res.score for res in results], n))
            if r:
                extra_s += time.perf_counter() - start
        with times.phase("rollout"):
            self.engine.sleep()
        chosen = pool.batch()
        comps = [dataclasses.replace(c, prompt_index=i) for i, g in enumerate(chosen) for c in g.completions]
        metrics = {**pool.metrics(n), "dynamic/extra_seconds": extra_s}
        return (
            [g.record for g in chosen],
            [g.prompt_ids for g in chosen],
            comps,
            [x for g in chosen for x in g.results],
            metrics,
        )

    @contextlib.contextmanager
    def training_state_on_device(self) -> Iterator[None]:
        """Work that reads the optimizer state between steps (a checkpoint, a stage start's
        optimizer reset and teacher update) runs with the engine asleep when the training state
        is offloaded, so that the two never share the device (memory_ledger.py, phase
        "checkpoint"); afterwards the state goes off again and the engine is refitted."""
        if not self.cfg.backend.offload_training_state:
            yield
            return
        self.engine.sleep()
        try:
            yield
        finally:
            self.backend.offload_training_state()
            self.engine.wake(("weights",))
            self.engine.update_weights(self.backend.export_weights(model="policy"))
            self.engine.wake(("kv_cache",))

    def _update(self, batch: SequenceBatch) -> dict[str, float]:
        """The optimizer step(s) on one rollout batch: `algorithm.grpo.mini_batches` of them."""
        a = self.cfg.algorithm
        return minibatch_update(
            self.backend,
            batch,
            self.loss_fn,
            mini_batches=a.grpo.mini_batches,
            group_size=a.group_size,
            skip=a.skip_zero_signal,
        )

    def _teacher_signal(self, batch: SequenceBatch, rewards: torch.Tensor) -> dict[str, float]:
        """Whether the teacher's signal points the right way: per distilled response, the mean
        per-token log-probability gain of the teacher (with its context) over the student that
        sampled it (rollout logprobs), averaged over rewarded (score >= 1) and unrewarded
        responses. SDPO only pulls towards correct answers when `teacher/gain_gap` =
        gain_rewarded - gain_unrewarded is clearly positive."""
        mask = batch.tensors[self.algorithm.distill_mask_key]
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
        from megatron_sdpo.diagnostics.artifacts import ONCE_TOKENS
        from megatron_sdpo.diagnostics.token_artifacts import artifact_endorsement, format_repeat_mask, mask_tensor

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

    def _attach_teacher(
        self, batch, records, texts, rewards, results, seed, *, domain: str, truncated: list[bool] | None = None
    ) -> tuple[list[bool], dict[str, float]]:
        """Teacher prompts (successful sibling and/or feedback) and the distillation mask, its
        safeguards applied: (which samples have a context, the safeguards' metrics); `truncated`
        marks responses cut at max_new_tokens (None: none was)."""
        from megatron_sdpo.algorithms.context import (
            build_teacher_contexts,
            teacher_feedbacks,
            templates_for,
            truncate_context_ids,
        )
        from megatron_sdpo.algorithms.sdpo import distill_mask, random_token_keep

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
            reasoning_end_ids=self._reasoning_end_ids,
            distill_cot=s.distill_cot,
        )
        # The paper code's random token masking of the distillation loss (an ablation of its
        # density); mask_ratio 0 leaves the mask as it is.
        keep = random_token_keep(tuple(mask.shape), s.mask_ratio, seed)
        batch.tensors[self.algorithm.distill_mask_key] = mask * has[:, None] * keep
        return [bool(h) for h in has], self._safeguard(batch, rewards, has)

    def _safeguard(self, batch: SequenceBatch, rewards: torch.Tensor, has: torch.Tensor) -> dict[str, float]:
        """The distillation mask's safeguards (algorithms/safeguards.py), where configured; their
        metrics go to the step's (`sdpo/gate_mean` over samples with a context, `sdpo/agree_frac`
        of the tokens the mask held before)."""
        from megatron_sdpo.algorithms.safeguards import agreement_mask, contrast_weights

        s, n, key = self.cfg.algorithm.sdpo, self.cfg.algorithm.group_size, self.algorithm.distill_mask_key
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
