"""Building the run's components from the config: model path, tokenizer, LR schedule, backend,
rollout. Everything built from a RunConfig is built here, so config/ imports nothing above it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.backend_spec import backend_spec
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.config.stack import check_stack
from megatron_sdpo.errors import ConfigError, UserError


def resolve_model_path(cfg: RunConfig) -> str:
    """ "tiny" -> the shipped tiny base ("tiny-boxdup": the artifact-injection base; built on
    first use); a packaged model's name (e.g.
    "smollm2-135m-instruct") -> its HF directory in the cache (converted on first use); a hub id
    (owner/name, not a directory here) -> its snapshot in the HF cache (fetched once per node);
    else an existing HF directory."""
    from megatron_sdpo.models.hf_dir import check_hf_model_dir
    from megatron_sdpo.models.packaged import PACKAGED_MODELS, ensure_packaged_model
    from megatron_sdpo.models.tiny import VARIANTS, ensure_tiny_base

    if cfg.model.path in VARIANTS:
        return str(check_hf_model_dir(ensure_tiny_base(variant=cfg.model.path), what=f"{cfg.model.path} base"))
    if cfg.model.path in PACKAGED_MODELS:
        return str(check_hf_model_dir(ensure_packaged_model(cfg.model.path), what=f"model {cfg.model.path}"))
    from megatron_sdpo.models import hub

    if hub.is_hub_id(cfg.model.path):
        return str(check_hf_model_dir(hub.fetch(cfg.model.path), what=f"model.path {cfg.model.path!r}"))
    path = Path(cfg.model.path)
    if not path.is_dir():
        raise UserError(f"model.path {cfg.model.path!r} is neither a local directory nor a hub id (owner/name)")
    # Config, shard index and safetensors headers, before vLLM or transformers open anything.
    return str(check_hf_model_dir(path, what="model.path"))


def load_tokenizer(model_path: str):
    """The model's tokenizer (pad = eos where unset). Also the first HF touch of a run, so
    transformers' per-load progress bars are switched off here."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the tokenizer of {model_path}: {str(exc).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def lr_schedule(cfg: RunConfig):
    """The backends' LRSchedule from `backend.lr_schedule` (of the run, or of a stage's
    effective config)."""
    from megatron_sdpo.interfaces.schedule import LRSchedule

    s = cfg.backend.lr_schedule
    return LRSchedule(style=s.style, warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio)


def transformer_engine_wanted(impl: str, *, gpu: bool | None = None, have_te: bool | None = None) -> bool | None:
    """`backend.megatron.transformer_impl` as ModelOptions.use_te (None: TE where importable on
    a GPU). A run on a CUDA machine without Transformer Engine is refused in one line unless it
    asks for the local layers: megatron-core would fall back to them without a word."""
    import torch

    from megatron_sdpo.backends.megatron.precision import have_transformer_engine

    gpu = torch.cuda.is_available() if gpu is None else gpu
    have_te = have_transformer_engine() if have_te is None else have_te
    if impl == "local":
        return False
    if not have_te and (impl == "transformer_engine" or gpu):
        raise ConfigError(
            "backend.megatron.transformer_impl="
            f"{impl}: Transformer Engine is not installed ({'on this CUDA machine' if gpu else 'here'}); "
            "install it (docs/dependencies.md) or set backend.megatron.transformer_impl=local "
            "(megatron-core's unfused layers: more activation memory, a slower step)"
        )
    return True if impl == "transformer_engine" else None


def make_backend(cfg: RunConfig, model_path: str, tokenizer):
    """The training backend named by `backend.name`."""
    b = cfg.backend
    common = dict(
        lr=b.lr,
        lr_schedule=lr_schedule(cfg),
        weight_decay=b.weight_decay,
        grad_clip=b.grad_clip,
        micro_batch_size=b.micro_batch_size,
        seed=cfg.seed,
        with_teacher=algorithm_spec(cfg.algorithm.name).uses_teacher,
        # The frozen base also serves the excess-KL diagnostic after every stage.
        with_reference=cfg.algorithm.grpo.kl_coef > 0 or cfg.diagnostics.enabled,
        pad_token_id=tokenizer.pad_token_id,
        # Trainer log-probs at the rollout temperature (verl / TRL): those the engine sampled from.
        logit_temperature=cfg.rollout.temperature,
    )
    if b.name == "hf":
        from megatron_sdpo.backends.hf import HFBackend

        spec = backend_spec(b.name)
        t = cfg.teacher
        return HFBackend(
            model_path,
            dtype=cfg.model.dtype,
            packing=bool(spec.packing(b)),
            pack_row_tokens=b.pack_row_tokens,
            share_prompts=spec.share_prompts(b),
            teacher_init=None if t.init_path is None else (t.init_path, t.init_alpha),
            teacher_logit_mix=t.trust_region_mix if t.mode == "trust_region" else None,
            **common,
        )
    if b.name == "megatron":
        check_stack(["megatron", "transformer_engine"])  # before megatron-core builds anything
        return _megatron_backend(cfg, model_path, common)
    raise ConfigError(f"backend.name: unknown backend {b.name!r}")  # pragma: no cover


def _megatron_backend(cfg: RunConfig, model_path: str, common: dict):
    """MegatronBackend from `backend.megatron.*` (parallel layout, precision, FP8, recompute)."""
    from megatron_sdpo.backends.megatron import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig

    m = cfg.backend.megatron
    recipe = None if m.fp8.recipe == "none" else m.fp8.recipe
    options = ModelOptions(
        use_te=transformer_engine_wanted(m.transformer_impl),
        precision=PrecisionConfig(params=m.params_dtype, fp8=recipe, fp8_format=m.fp8.fp8_format if recipe else None),
        sequence_parallel=m.sequence_parallel,
        recompute=None if m.recompute == "none" else m.recompute,
        vocab_divisor=m.vocab_divisor,
    )
    return MegatronBackend(
        model_path,
        parallel=ParallelConfig(tp=m.tensor_parallel, pp=m.pipeline_parallel, sequence_parallel=m.sequence_parallel),
        options=options,
        distributed_optimizer=m.distributed_optimizer,
        loss_chunk_tokens=m.loss_chunk_tokens,
        # None: the backend packs wherever the model's layers take packed rows.
        packing=backend_spec(cfg.backend.name).packing(cfg.backend),
        **common,
    )


def vllm_seeding(setting: str) -> str:
    """rollout.seeding resolved: "auto" is the batched engine seed on GPU and per-request seeds
    on CPU, where the replica tests hold samples layout-invariant and the per-request loop costs
    little next to the model."""
    if setting != "auto":
        return setting
    import torch

    return "engine" if torch.cuda.is_available() else "request"


def rollout_dtype(cfg: RunConfig) -> str:
    """The rollout engine's dtype: `rollout.dtype`, or the model's where it is auto."""
    return cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def make_rollout(cfg: RunConfig, model_path: str, tokenizer, work_dir: str):
    """The rollout engine named by `rollout.engine` ("auto": vLLM where installed, else HF)."""
    from megatron_sdpo.rollout import make_engine, vllm_available

    os.makedirs(work_dir, exist_ok=True)
    kind = cfg.rollout.engine
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
    if kind == "vllm":
        check_stack(["vllm"])  # before vLLM loads the weights
    if kind != "vllm" and cfg.rollout.tensor_parallel_size != 1:
        raise ConfigError(
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} needs rollout.engine=vllm (the "
            f"engine here is {kind})"
        )
    from megatron_sdpo.rollout.replicas import ReplicaLayout, ReplicatedRollout

    # Checked before anything loads: the tensor-parallel size must fit the launch.
    layout = ReplicaLayout.of_launch(cfg.rollout.tensor_parallel_size) if kind == "vllm" else None
    common: dict[str, Any] = dict(
        seed=cfg.seed,
        dtype=rollout_dtype(cfg),
        max_model_len=cfg.rollout.max_model_len,
        eos_token_ids=[tokenizer.eos_token_id],
        detokenize=True,
        threads=cfg.rollout.threads,
    )
    if layout is not None:  # vLLM
        from megatron_sdpo.ranks import rank

        engine = make_engine(
            "vllm",
            model_path=model_path,
            # Each rank's engine part keeps its caches and sockets apart from the others'.
            run_dir=work_dir if layout.world == 1 else os.path.join(work_dir, f"rank_{rank()}"),
            bucket_bytes=cfg.rollout.bucket_bytes,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            sleep_level=cfg.rollout.sleep_level,
            max_num_seqs=max(cfg.algorithm.prompts_per_step * cfg.algorithm.group_size, cfg.eval.batch_size),
            tensor_parallel_size=layout.tp,
            prefix_caching=cfg.rollout.prefix_caching,
            enforce_eager=cfg.rollout.enforce_eager,
            seeding=vllm_seeding(cfg.rollout.seeding),
            **common,
        )
        # Several ranks: each replica generates its share of a call's prompts, gathered to all.
        return engine if layout.world == 1 else ReplicatedRollout(engine, layout)
    return make_engine(
        "hf",
        model_path=model_path,
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=cfg.eval.batch_size * 2,
        **common,
    )
