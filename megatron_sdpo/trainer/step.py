"""One on-policy RL step: rollout -> verify -> advantages / teacher contexts -> update -> sync.

The algorithm-specific parts are the loss (algorithms/registry.py) and the tensors it reads;
SDPO's teacher plumbing is teacher.py, the optimizer steps update.py; everything here is shared
between GRPO, SDPO, StableSDPO and the hybrid. What the step asks of the loop that drives it is
one small hooks object (`StepHooks`, implemented by continual.ContinualRun).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_sdpo.algorithms.grpo import group_advantages
from megatron_sdpo.algorithms.registry import build_loss
from megatron_sdpo.chat import record_prompts
from megatron_sdpo.config.algorithm_spec import AlgorithmSpec, algorithm_spec
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.interfaces.backend import Backend, LossFn, SequenceBatch
from megatron_sdpo.rollout.base import RolloutEngine, SamplingConfig
from megatron_sdpo.rollout.group_filter import Group, GroupPool, informative
from megatron_sdpo.rollout.guard import GuardedLoss, RefitGuard, attach_guard_tensors
from megatron_sdpo.rollout.scoring import score_shared
from megatron_sdpo.stopwatch import PhaseTimes
from megatron_sdpo.trainer.teacher import SelfTeacher
from megatron_sdpo.trainer.update import minibatch_update


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


class StepHooks(Protocol):
    """What a step asks of the loop that drives it (continual.ContinualRun implements it)."""

    def after_train(self, step: int) -> None:
        """After the optimizer step of (0-based) `step`, while the engine still sleeps: the
        teacher's per-step update (its transients never share the device with vLLM)."""

    def refill(self, step: int, round_: int) -> list[dict]:
        """The prompts of extra generation round `round_` >= 1 of `step` when
        `algorithm.filter_groups` is on (rollout/group_filter.py)."""
        ...

    def between_phases(self, left: tuple[str, ...]) -> None:
        """Before the teacher and before the train phase, with the phases still to come; may
        raise StepAbandoned (stop_request.py): nothing the step changes is changed before the
        first optimizer step."""


@dataclass
class StepOutput:
    metrics: dict
    responses: list[str]
    truncated: list[bool]
    token_lengths: list[int]
    has_context: list[bool]


class Trainer:
    """Runs RL steps for one policy through a backend and a rollout engine."""

    def __init__(self, cfg: RunConfig, backend: Backend, engine: RolloutEngine, tokenizer: Any):
        self.backend = backend
        self.engine = engine
        self.tokenizer = tokenizer
        self.guard = RefitGuard(cfg.rollout.guard.max_mismatch)
        self.configure(cfg)

    def _loss(self, cfg: RunConfig) -> LossFn:
        """The configured loss, for this trainer's backend. With one optimizer step per rollout
        batch its own forward pass also measures how far the engine's logprobs are off
        (rollout/guard.py); with several, the guard reads the old log-probabilities computed
        before the first step instead (later steps see a policy that has already moved)."""
        loss = build_loss(cfg, topk_source=self.backend.topk_source)
        return GuardedLoss(loss) if cfg.algorithm.grpo.mini_batches == 1 else loss

    @property
    def algorithm(self) -> AlgorithmSpec:
        """The configured algorithm's spec (uses teacher / advantages, distillation mask)."""
        return algorithm_spec(self.cfg.algorithm.name)

    @property
    def uses_teacher(self) -> bool:
        return self.algorithm.uses_teacher

    def configure(self, cfg: RunConfig) -> None:
        """Run with `cfg` from now on (a stage's settings: config/stages.py)."""
        self.cfg = cfg
        self.loss_fn = self._loss(cfg)
        self.teacher = SelfTeacher(cfg, self.backend, self.tokenizer) if self.uses_teacher else None

    def step(
        self,
        domain: str,
        records: list[dict],
        *,
        seed: int,
        step: int = 0,
        label: str | None = None,
        hooks: StepHooks | None = None,
    ) -> StepOutput:
        """One optimizer step on `records` (prompts_per_step records of one domain); `step`
        (0-based within the stage) schedules the periodic diagnostics; `label` names the step
        in a refit-guard error; `hooks` the driving loop's part (StepHooks; None: no teacher
        update, no extra generation round, no stop check inside the step).

        Engine order: generate (awake) -> sleep (frees weights and KV cache while training) ->
        train -> wake the weights -> refit -> wake the KV cache -> next generate."""
        cfg, a = self.cfg, self.cfg.algorithm
        n = a.group_size
        times = PhaseTimes(self.backend.device)
        dynamic: dict[str, float] = {}
        if a.filter_groups.enabled:
            refill = (lambda r: hooks.refill(step, r)) if hooks is not None else None
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
        if hooks is not None:
            hooks.between_phases(("teacher", "train", "sync") if self.teacher is not None else ("train", "sync"))
        if self.algorithm.uses_advantages:
            batch.tensors["advantages"] = group_advantages(rewards, group_size=n, norm_by_std=a.grpo.norm_by_std)
        signal: dict[str, float] = {}
        if self.teacher is not None:
            with times.phase("teacher"):
                has_context, signal = self.teacher.attach(
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
                    signal.update(self.teacher.signal(batch, rewards))
            if hooks is not None:
                hooks.between_phases(("train", "sync"))
        with times.phase("train"):
            train_metrics = self._update(batch)
            if hooks is not None:
                hooks.after_train(step)
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
