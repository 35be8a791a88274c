"""Cross-field checks of a typed `RunConfig` that types alone cannot express: the one place
each bound of a config value is checked (engines and maths below trust a validated config)."""

from __future__ import annotations

from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.backend_spec import BACKENDS, backend_spec
from megatron_sdpo.config.schema import DOMAINS, RunConfig, TeacherConfig
from megatron_sdpo.config.stages import stage_config
from megatron_sdpo.errors import ConfigError


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


def _check(cfg: RunConfig) -> None:
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
    a = cfg.algorithm
    spec = algorithm_spec(a.name)
    if a.group_size < 2 and spec.uses_teacher:
        raise ConfigError("algorithm.group_size must be >= 2 for SDPO (it needs siblings)")
    if a.group_size < 1 or a.prompts_per_step < 1:
        raise ConfigError("algorithm.group_size and algorithm.prompts_per_step must be >= 1")
    if not 0.0 <= a.sdpo.alpha <= 1.0:
        raise ConfigError(f"algorithm.sdpo.alpha must be in [0, 1], got {a.sdpo.alpha}")
    if a.sdpo.topk is not None and a.sdpo.topk < 1:
        raise ConfigError("algorithm.sdpo.topk must be >= 1 or null")
    if not 0.0 <= a.sdpo.hybrid_lambda <= 1.0:
        raise ConfigError("algorithm.sdpo.hybrid_lambda must be in [0, 1]")
    if not 0.0 <= a.sdpo.mask_ratio < 1.0:
        raise ConfigError(
            f"algorithm.sdpo.mask_ratio must be in [0, 1) (1 would distil no token), got {a.sdpo.mask_ratio:g}"
        )
    if a.sdpo.contrast_gate is not None and not a.sdpo.contrast_gate >= 0:
        raise ConfigError(
            f"algorithm.sdpo.contrast_gate must be >= 0 (0: the binary gate) or null, got {a.sdpo.contrast_gate:g}"
        )
    _validate_context(a.sdpo.context, "algorithm.sdpo.context")
    if a.grpo.mini_batches < 1:
        raise ConfigError("algorithm.grpo.mini_batches must be >= 1")
    if not cfg.checkpoint.write_gib_per_s > 0:
        raise ConfigError(f"checkpoint.write_gib_per_s must be > 0, got {cfg.checkpoint.write_gib_per_s}")
    if a.filter_groups.max_extra_rounds < 0:
        raise ConfigError(
            f"algorithm.filter_groups.max_extra_rounds must be >= 0, got {a.filter_groups.max_extra_rounds}"
        )
    if a.grpo.mini_batches > 1 and not spec.supports_mini_batches:
        raise ConfigError("algorithm.grpo.mini_batches > 1 needs algorithm.name=grpo")
    if a.prompts_per_step % a.grpo.mini_batches:
        raise ConfigError(
            f"algorithm.prompts_per_step={a.prompts_per_step} does not split into "
            f"algorithm.grpo.mini_batches={a.grpo.mini_batches} mini-batches of whole prompt groups"
        )
    if a.grpo.dual_clip is not None and a.grpo.dual_clip <= 1.0:
        raise ConfigError("algorithm.grpo.dual_clip must be > 1 or null")
    if spec.requires_teacher_mode and cfg.teacher.mode != spec.teacher_mode:
        raise ConfigError(f"algorithm.name={a.name} needs teacher.mode={spec.teacher_mode}")
    if not 0.0 < cfg.teacher.ema_rate <= 1.0:
        # 0 would be a teacher that never moves: that is teacher.mode=frozen.
        raise ConfigError(
            "teacher.ema_rate must be in (0, 1] (a frozen teacher is teacher.mode=frozen), got "
            f"{cfg.teacher.ema_rate:g}"
        )
    if not 0.0 < cfg.teacher.freeze_fraction <= 1.0:
        raise ConfigError("teacher.freeze_fraction must be in (0, 1]")
    _validate_teacher(cfg)
    e = cfg.eval
    if e.temperature is not None and e.temperature <= 0:
        raise ConfigError(f"eval.temperature must be > 0 or null (greedy is eval.greedy=true), got {e.temperature:g}")
    if not 0.0 < e.top_p <= 1.0:
        raise ConfigError(f"eval.top_p must be in (0, 1], got {e.top_p:g}")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in e.at_steps):
        raise ConfigError(f"eval.at_steps must be a list of steps >= 1 within a stage, got {e.at_steps!r}")
    if cfg.diagnostics.teacher_signal_every < 0:
        raise ConfigError("diagnostics.teacher_signal_every must be >= 0 (0: off)")
    if cfg.diagnostics.threads < 0:
        raise ConfigError(f"diagnostics.threads must be >= 0 (0: automatic), got {cfg.diagnostics.threads}")
    if cfg.diagnostics.ood_distance_n < 0:
        raise ConfigError(f"diagnostics.ood_distance_n must be >= 0 (0: off), got {cfg.diagnostics.ood_distance_n}")
    if cfg.diagnostics.drift_every < 0:
        raise ConfigError(f"diagnostics.drift_every must be >= 0 (0: off), got {cfg.diagnostics.drift_every}")
    r = cfg.diagnostics.collapse_min_length_ratio
    if r is not None and not 0.0 < r <= 1.0:
        raise ConfigError("diagnostics.collapse_min_length_ratio must be in (0, 1] or null")
    r = cfg.diagnostics.collapse_min_reward_ratio
    if r is not None and not 0.0 < r <= 1.0:
        raise ConfigError("diagnostics.collapse_min_reward_ratio must be in (0, 1] or null")
    if cfg.backend.lr <= 0:
        raise ConfigError("backend.lr must be > 0")
    if cfg.backend.micro_batch_size < 1:
        raise ConfigError("backend.micro_batch_size must be >= 1")
    if cfg.backend.pack_row_tokens < 0:
        raise ConfigError("backend.pack_row_tokens must be >= 0 (0: one packed row per micro-batch)")
    bspec = backend_spec(cfg.backend.name)
    if cfg.backend.share_prompts is True and not (bspec.shares_prompts and bspec.packing(cfg.backend) is not False):
        raise ConfigError(
            "backend.share_prompts=true needs the HF backend's packed layout (backend.packing on; "
            "megatron's THD rows cannot state the shared-prompt mask); set backend.share_prompts=false or null"
        )
    _validate_lr_schedule(cfg)
    m = cfg.backend.megatron
    if m.tensor_parallel < 1 or m.pipeline_parallel < 1:
        raise ConfigError("backend.megatron.tensor_parallel / pipeline_parallel must be >= 1")
    if isinstance(m.vocab_divisor, bool) or m.vocab_divisor < 1:
        raise ConfigError(f"backend.megatron.vocab_divisor must be >= 1, got {m.vocab_divisor!r}")
    if isinstance(m.loss_chunk_tokens, bool) or m.loss_chunk_tokens < 0:
        raise ConfigError(
            f"backend.megatron.loss_chunk_tokens must be >= 0 (0: no chunking), got {m.loss_chunk_tokens!r}"
        )
    if m.sequence_parallel and m.tensor_parallel == 1:
        raise ConfigError("backend.megatron.sequence_parallel needs tensor_parallel > 1")
    if cfg.kernel.fused_kl and spec.uses_teacher and (a.sdpo.topk is not None or a.sdpo.variant != "logits"):
        raise ConfigError(
            "kernel.fused_kl=true is the full-vocabulary path: it needs algorithm.sdpo.topk=null and variant=logits"
        )
    if bspec.vocab_sharded_logits and m.tensor_parallel > 1 and spec.uses_teacher and a.sdpo.variant == "logits":
        # Full logits are vocab-sharded under TP: the full-vocabulary distillation goes through
        # the vocab-parallel KL (top-k is computed from shards by the backend).
        if a.sdpo.topk is None and not cfg.kernel.fused_kl:
            raise ConfigError(
                "full-vocabulary SDPO (sdpo.topk=null) with backend.megatron.tensor_parallel > 1 needs "
                "kernel.fused_kl=true"
            )
    if not cfg.launch.distributed_timeout_minutes > 0:
        raise ConfigError(
            f"launch.distributed_timeout_minutes must be > 0, got {cfg.launch.distributed_timeout_minutes:g}"
        )
    ro = cfg.rollout
    if not ro.temperature > 0:
        raise ConfigError(f"rollout.temperature must be > 0 (greedy evaluation is eval.greedy), got {ro.temperature}")
    if ro.tensor_parallel_size < 1:
        raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {ro.tensor_parallel_size}")
    if ro.threads is not None and ro.threads < 1:
        raise ConfigError(f"rollout.threads must be >= 1 or null, got {ro.threads}")
    if ro.bucket_bytes is not None and ro.bucket_bytes <= 0:
        raise ConfigError(f"rollout.bucket_bytes must be > 0, got {ro.bucket_bytes}")
    if ro.guard.max_mismatch is not None:
        if not ro.guard.max_mismatch > 0:
            raise ConfigError(f"rollout.guard.max_mismatch must be > 0 or null, got {ro.guard.max_mismatch}")
        if ro.top_p != 1.0:
            raise ConfigError(
                "rollout.guard.max_mismatch compares the engine's logprobs with the trainer's, which renormalize over "
                "the whole vocabulary, not the top-p nucleus: it needs rollout.top_p=1 (or "
                "rollout.guard.max_mismatch=null)"
            )
    if m.fp8.recipe != "none" and not bspec.fp8:
        raise ConfigError(
            f"backend.megatron.fp8.recipe needs backend.name={' or '.join(n for n, s in BACKENDS.items() if s.fp8)}"
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
    if s.warmup_steps < 0:
        raise ConfigError(f"backend.lr_schedule.warmup_steps={s.warmup_steps} must be >= 0")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"backend.lr_schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
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
    if not 0.0 <= t.init_alpha <= 1.0:
        raise ConfigError(f"teacher.init_alpha must be in [0, 1], got {t.init_alpha:g}")
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
    if not 0.0 <= t.trust_region_mix <= 1.0:
        raise ConfigError(f"teacher.trust_region_mix must be in [0, 1], got {t.trust_region_mix:g}")
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
    if ctx.max_context_tokens is not None and ctx.max_context_tokens < 1:
        raise ConfigError(f"{where}.max_context_tokens must be >= 1 or null")
    for name in ("max_solution_chars", "max_feedback_chars"):
        v = getattr(ctx, name)
        if v is not None and v <= 3:
            raise ConfigError(f"{where}.{name} must be > 3 or null")
