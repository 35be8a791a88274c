"""The one gate of a typed `RunConfig`: every bound of a config value (the `BOUNDS` table, one
row per bounded field of the schema) and every rule across fields, section by section. Engines
and maths below trust a validated config: their own checks are asserts. `run --dry-run` loads
the config through here, so a bad value is one line there, before any model loads.
(tests/unit/config/test_bounds.py: every numeric field of the schema is in BOUNDS or in
UNBOUNDED, and every row refuses a value outside its bound.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.backend_spec import BACKENDS, backend_spec
from megatron_sdpo.config.schema import RunConfig, TeacherConfig
from megatron_sdpo.config.stages import stage_config
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.domains import DOMAINS


def validate(cfg: RunConfig) -> RunConfig:
    """`cfg` after checking it and the configuration each stage runs with (its per-stage
    overrides merged: config/stages.py); ConfigError naming the dotted key otherwise."""
    _check(cfg)
    for i in range(len(cfg.stages)):
        eff = stage_config(cfg, i)  # known keys, allowed per stage
        if eff is cfg:
            continue
        try:
            _check(eff)
        except ConfigError as exc:
            raise ConfigError(f"stages.{i} (per-stage settings): {exc}") from None
    return cfg


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a numeric field accepts: `ok(value)`, said as `says` in the error; `null` allows None."""

    ok: Callable[[Any], bool]
    says: str
    null: bool = False

    def holds(self, v: Any) -> bool:
        if v is None:
            return self.null
        return not isinstance(v, bool) and self.ok(v)


def at_least(lo: float, note: str = "", *, null: bool = False) -> Bound:
    return Bound(lambda v: v >= lo, f">= {lo:g}{note}{' or null' if null else ''}", null)


def above(lo: float, note: str = "", *, null: bool = False) -> Bound:
    return Bound(lambda v: v > lo, f"> {lo:g}{note}{' or null' if null else ''}", null)


def within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False, note: str = "") -> Bound:
    def ok(v):
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return Bound(ok, f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}{note}")


# Every bounded numeric field of the schema, by section (stage overrides are checked with the
# stage's merged config). The per-domain data sources are checked in _validate_source.
BOUNDS: dict[str, Bound] = {
    "seed": within(0, 2**32 - 1, note=" (numpy's seed range)"),
    # algorithm
    "algorithm.prompts_per_step": at_least(1),
    "algorithm.group_size": at_least(1),
    "algorithm.filter_groups.max_extra_rounds": at_least(0),
    "algorithm.grpo.clip_low": within(0, 1, hi_open=True),
    "algorithm.grpo.clip_high": at_least(0),
    "algorithm.grpo.kl_coef": at_least(0),
    "algorithm.grpo.tis_cap": above(0, null=True),
    "algorithm.grpo.mini_batches": at_least(1),
    "algorithm.grpo.dual_clip": above(1, null=True),
    "algorithm.sdpo.alpha": within(0, 1),
    "algorithm.sdpo.topk": at_least(1, null=True),
    "algorithm.sdpo.is_clip": above(0, null=True),
    "algorithm.sdpo.mask_ratio": within(0, 1, hi_open=True, note=" (1 would distil no token)"),
    "algorithm.sdpo.contrast_gate": at_least(0, " (0: the binary gate)", null=True),
    "algorithm.sdpo.hybrid_lambda": within(0, 1),
    "algorithm.sdpo.context.max_solution_chars": above(3, null=True),
    "algorithm.sdpo.context.max_feedback_chars": above(3, null=True),
    "algorithm.sdpo.context.max_context_tokens": at_least(1, null=True),
    # teacher
    "teacher.ema_rate": within(0, 1, lo_open=True, note=" (a frozen teacher is teacher.mode=frozen)"),
    "teacher.trust_region_mix": within(0, 1),
    "teacher.freeze_fraction": within(0, 1, lo_open=True),
    "teacher.init_alpha": within(0, 1),
    # rollout
    "rollout.temperature": above(0, " (greedy evaluation is eval.greedy)"),
    "rollout.top_p": within(0, 1, lo_open=True),
    "rollout.max_new_tokens": at_least(1),
    "rollout.max_model_len": at_least(1),
    "rollout.bucket_bytes": above(0, null=True),
    "rollout.gpu_memory_utilization": within(0, 1, lo_open=True),
    "rollout.tensor_parallel_size": at_least(1),
    "rollout.threads": at_least(1, null=True),
    "rollout.guard.max_mismatch": above(0, null=True),
    # backend
    "backend.lr": above(0),
    "backend.lr_schedule.warmup_steps": at_least(0),
    "backend.lr_schedule.min_lr_ratio": within(0, 1),
    "backend.weight_decay": at_least(0),
    "backend.grad_clip": at_least(0, " (0: no clipping)"),
    "backend.micro_batch_size": at_least(1),
    "backend.pack_row_tokens": at_least(0, " (0: one packed row per micro-batch)"),
    "backend.megatron.tensor_parallel": at_least(1),
    "backend.megatron.pipeline_parallel": at_least(1),
    "backend.megatron.vocab_divisor": at_least(1),
    "backend.megatron.loss_chunk_tokens": at_least(0, " (0: no chunking)"),
    "kernel.chunk_tokens": at_least(1),
    "kernel.chunk_vocab": at_least(1),
    # eval
    "eval.avg_k": at_least(0, " (0: one answer per item)"),
    "eval.temperature": above(0, " (greedy is eval.greedy=true)", null=True),
    "eval.top_p": within(0, 1, lo_open=True),
    "eval.max_new_tokens": at_least(1),
    "eval.batch_size": at_least(1),
    # checkpoint
    "checkpoint.save_every": at_least(0, " (0: stage ends only)"),
    "checkpoint.keep_last": at_least(0),
    "checkpoint.write_gib_per_s": above(0),
    # diagnostics
    "diagnostics.probe_n": at_least(0),
    "diagnostics.svd_rank": at_least(1),
    "diagnostics.collapse_repeat_threshold": within(0, 1, lo_open=True),
    "diagnostics.collapse_min_length_ratio": Bound(lambda v: 0 < v <= 1, "in (0, 1] or null", null=True),
    "diagnostics.collapse_min_reward_ratio": Bound(lambda v: 0 < v <= 1, "in (0, 1] or null", null=True),
    "diagnostics.teacher_signal_every": at_least(0, " (0: off)"),
    "diagnostics.threads": at_least(0, " (0: automatic)"),
    "diagnostics.ood_distance_n": at_least(0, " (0: off)"),
    "diagnostics.drift_every": at_least(0, " (0: off)"),
    # launch
    "launch.nodes": at_least(1),
    "launch.gpus_per_node": at_least(1),
    "launch.distributed_timeout_minutes": above(0),
}

# Numeric fields with no bound, and why (the schema test requires every numeric field in one of
# the two tables).
UNBOUNDED: dict[str, str] = {
    "algorithm.sdpo.context.success_threshold": "a reward level: any value is a threshold",
    "eval.at_steps": "a list, checked in _check_eval",
}


def value_at(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_bounds(cfg: RunConfig) -> None:
    """Every row of BOUNDS on `cfg`: ConfigError `<key> must be <bound>, got <value>`."""
    for key, bound in BOUNDS.items():
        v = value_at(cfg, key)
        if not bound.holds(v):
            raise ConfigError(f"{key} must be {bound.says}, got {v!r}")


def _check(cfg: RunConfig) -> None:
    check_bounds(cfg)
    _check_stages_and_domains(cfg)
    _check_algorithm(cfg)
    _validate_teacher(cfg)
    _check_eval(cfg)
    _check_backend(cfg)
    _check_rollout(cfg)


def _check_stages_and_domains(cfg: RunConfig) -> None:
    if not cfg.stages:
        raise ConfigError("stages: at least one stage is needed")
    for i, stage in enumerate(cfg.stages):
        if stage.domain not in cfg.domains:
            raise ConfigError(f"stages.{i}.domain: unknown domain {stage.domain!r}; known: {', '.join(cfg.domains)}")
        if stage.steps < 0:
            raise ConfigError(f"stages.{i}.steps must be >= 0")
    for name, dcfg in cfg.domains.items():
        if name not in DOMAINS:
            raise ConfigError(f"domains.{name}: unknown domain; known: {', '.join(DOMAINS)}")
        for where, src in [("train", dcfg.train), *((f"eval.{k}", v) for k, v in dcfg.eval.items())]:
            _validate_source(src, f"domains.{name}.{where}", train=where == "train")
        for k, shot in enumerate(dcfg.shots):
            for part in ("user", "assistant"):
                if not getattr(shot, part).strip():
                    raise ConfigError(f"domains.{name}.shots.{k}.{part} must be non-empty text")


def _check_algorithm(cfg: RunConfig) -> None:
    a = cfg.algorithm
    spec = algorithm_spec(a.name)
    if a.group_size < 2 and spec.uses_teacher:
        raise ConfigError("algorithm.group_size must be >= 2 for SDPO (it needs siblings)")
    if a.sdpo.variant == "sampled" and a.sdpo.alpha != 1.0 and spec.uses_teacher:
        raise ConfigError(
            "algorithm.sdpo.variant=sampled is the reverse KL only and needs algorithm.sdpo.alpha=1, got "
            f"{a.sdpo.alpha}"
        )
    _validate_context(a.sdpo.context, "algorithm.sdpo.context")
    if a.grpo.mini_batches > 1 and not spec.supports_mini_batches:
        raise ConfigError("algorithm.grpo.mini_batches > 1 needs algorithm.name=grpo")
    if a.prompts_per_step % a.grpo.mini_batches:
        raise ConfigError(
            f"algorithm.prompts_per_step={a.prompts_per_step} does not split into "
            f"algorithm.grpo.mini_batches={a.grpo.mini_batches} mini-batches of whole prompt groups"
        )
    if spec.requires_teacher_mode and cfg.teacher.mode != spec.teacher_mode:
        raise ConfigError(f"algorithm.name={a.name} needs teacher.mode={spec.teacher_mode}")
    if cfg.kernel.fused_kl and spec.uses_teacher and (a.sdpo.topk is not None or a.sdpo.variant != "logits"):
        raise ConfigError(
            "kernel.fused_kl=true is the full-vocabulary path: it needs algorithm.sdpo.topk=null and variant=logits"
        )


def _check_eval(cfg: RunConfig) -> None:
    e = cfg.eval
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in e.at_steps):
        raise ConfigError(f"eval.at_steps must be a list of steps >= 1 within a stage, got {e.at_steps!r}")


def _check_backend(cfg: RunConfig) -> None:
    a = cfg.algorithm
    spec = algorithm_spec(a.name)
    bspec = backend_spec(cfg.backend.name)
    if cfg.backend.share_prompts is True and not (bspec.shares_prompts and bspec.packing(cfg.backend) is not False):
        raise ConfigError(
            "backend.share_prompts=true needs the HF backend's packed layout (backend.packing on; "
            "megatron's THD rows cannot state the shared-prompt mask); set backend.share_prompts=false or null"
        )
    _validate_lr_schedule(cfg)
    m = cfg.backend.megatron
    if m.sequence_parallel and m.tensor_parallel == 1:
        raise ConfigError("backend.megatron.sequence_parallel needs tensor_parallel > 1")
    if bspec.vocab_sharded_logits and m.tensor_parallel > 1 and spec.uses_teacher and a.sdpo.variant == "logits":
        # Full logits are vocab-sharded under TP: the full-vocabulary distillation goes through
        # the vocab-parallel KL (top-k is computed from shards by the backend).
        if a.sdpo.topk is None and not cfg.kernel.fused_kl:
            raise ConfigError(
                "full-vocabulary SDPO (sdpo.topk=null) with backend.megatron.tensor_parallel > 1 needs "
                "kernel.fused_kl=true"
            )
    if m.fp8.recipe != "none" and m.transformer_impl == "local":
        raise ConfigError(
            "backend.megatron.fp8.recipe runs through Transformer Engine: not with transformer_impl=local"
        )
    if m.fp8.recipe != "none" and not bspec.fp8:
        raise ConfigError(
            f"backend.megatron.fp8.recipe needs backend.name={' or '.join(n for n, s in BACKENDS.items() if s.fp8)}"
        )


def _check_rollout(cfg: RunConfig) -> None:
    ro = cfg.rollout
    if ro.engine == "hf" and ro.tensor_parallel_size != 1:
        raise ConfigError(
            f"rollout.tensor_parallel_size={ro.tensor_parallel_size} needs rollout.engine=vllm (the HF engine "
            "holds one model per rank)"
        )
    if ro.guard.max_mismatch is not None and ro.top_p != 1.0:
        raise ConfigError(
            "rollout.guard.max_mismatch compares the engine's logprobs with the trainer's, which renormalize over "
            "the whole vocabulary, not the top-p nucleus: it needs rollout.top_p=1 (or "
            "rollout.guard.max_mismatch=null)"
        )
    if cfg.backend.name == "megatron" and ro.dtype not in ("auto", cfg.model.dtype):
        raise ConfigError(
            f"rollout.dtype={ro.dtype} with backend megatron: the memory plan holds the engine in model.dtype "
            f"({cfg.model.dtype}); leave rollout.dtype=auto"
        )


def _validate_source(src, key: str, *, train: bool) -> None:
    """One `DataSource`: the synthetic-only and file-only keys, and their bounds."""
    synthetic = src.source == "synthetic"
    if src.instruction is not None and not synthetic:
        raise ConfigError(f"{key}.instruction applies to synthetic sources only (source: {src.source})")
    if src.instruction is not None and not src.instruction.strip():
        raise ConfigError(f"{key}.instruction must be non-empty or null")
    if src.difficulty is not None:
        if not synthetic:
            raise ConfigError(f"{key}.difficulty applies to synthetic sources only (source: {src.source})")
        if isinstance(src.difficulty, bool) or not 0.0 <= float(src.difficulty) <= 1.0:
            raise ConfigError(f"{key}.difficulty must be in [0, 1] or null, got {src.difficulty!r}")
    if src.compact and not synthetic:
        raise ConfigError(f"{key}.compact applies to synthetic sources only (source: {src.source})")
    if src.extra_files and (synthetic or train):
        raise ConfigError(f"{key}.extra_files applies to file-backed eval splits only")
    if (src.where or src.part is not None) and synthetic:
        raise ConfigError(f"{key}.where and .part apply to file sources only")
    for column, values in src.where.items():
        if not values:
            raise ConfigError(f"{key}.where.{column} must list at least one value")
    if src.part is not None:
        if len(src.part) != 2 or not 0.0 <= src.part[0] < src.part[1] <= 1.0:
            raise ConfigError(f"{key}.part must be [lo, hi] with 0 <= lo < hi <= 1, got {src.part}")


def _validate_lr_schedule(cfg: RunConfig) -> None:
    """`backend.lr_schedule` (the style is a Literal, checked when built): the warmup must end
    inside every stage, counted in optimizer steps (mini_batches per rollout step)."""
    s = cfg.backend.lr_schedule
    for i, stage in enumerate(cfg.stages):
        total = stage.steps * cfg.algorithm.grpo.mini_batches
        if total > 0 and s.warmup_steps >= total:
            raise ConfigError(
                f"backend.lr_schedule.warmup_steps={s.warmup_steps} must be smaller than the stage's {total} "
                f"optimizer steps (stages.{i})"
            )


def _validate_teacher(cfg: RunConfig) -> None:
    """The ported reference teacher options: initialisation from a checkpoint and the
    trust-region teacher (HF backend only: megatron's teacher has neither a checkpoint loader
    nor a second policy forward on the teacher's context)."""
    t = cfg.teacher
    if t.init_path is not None and not t.init_path.strip():
        raise ConfigError("teacher.init_path must be a model directory or null")
    spec = backend_spec(cfg.backend.name)
    able = ", ".join(n for n, s in BACKENDS.items() if s.trust_region_teacher)
    if t.mode == "trust_region" and not spec.trust_region_teacher:
        raise ConfigError(
            f"teacher.mode=trust_region needs backend.name={able} (the {cfg.backend.name} backend does not "
            "implement it)"
        )
    able = ", ".join(n for n, s in BACKENDS.items() if s.teacher_init)
    if t.init_path is not None and not spec.teacher_init:
        raise ConfigError(
            f"teacher.init_path needs backend.name={able} (the {cfg.backend.name} backend does not implement it)"
        )
    if t.mode == "trust_region":
        if cfg.kernel.fused_kl:
            raise ConfigError(
                "teacher.mode=trust_region mixes the teacher's and the student's logits: it needs kernel.fused_kl=false"
            )
        # ema_rate was once this mode's mixing coefficient: a value set for it here is refused, not ignored.
        moved = "the trust-region teacher has no EMA; its logit mix is teacher.trust_region_mix (one per run)"
        if t.ema_rate != TeacherConfig.ema_rate:
            raise ConfigError(f"teacher.ema_rate={t.ema_rate:g} with teacher.mode=trust_region: {moved}")
        for i, stage in enumerate(cfg.stages):
            if "ema_rate" in stage.teacher:
                raise ConfigError(f"stages.{i}.teacher.ema_rate with teacher.mode=trust_region: {moved}")


def _validate_context(ctx, where: str) -> None:
    for k, d in enumerate(ctx.feedback_domains):
        if d not in DOMAINS:
            raise ConfigError(f"{where}.feedback_domains.{k}: unknown domain {d!r}; known: {', '.join(DOMAINS)}")
    if ctx.reprompt_template is not None:
        for f in ("{prompt}", "{solution}", "{feedback}"):
            if f not in ctx.reprompt_template:
                raise ConfigError(f"{where}.reprompt_template must contain the field {f}")
