"""Dry run of `megatron-sdpo run`: what a launch would do, checked without loading weights.

`plan(cfg, world_size)` resolves the trainer layout (TP x PP x DP over the world), the rollout
plan (vLLM tensor-parallel size, replicas, prompts per replica), the batch split, the data
sources (schemas checked; files that exist are parsed for their first rows, missing ones are
warnings: a login node often does not hold the data the job will read) and each phase's memory
per rank from the memory ledger (memory_ledger.py; a phase over the device is an error). The
architecture comes from the model directory's config.json when it is
there, else from a small built-in table of the paper models (with a note saying so).

Every error is one line (ConfigError / DataError); `LaunchPlan.render()` is what `--dry-run`
prints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_sdpo.config.algorithm_spec import algorithm_spec
from megatron_sdpo.config.backend_spec import backend_spec
from megatron_sdpo.config.schema import RunConfig, eval_samples_per_item
from megatron_sdpo.errors import ConfigError, DataError, UserError
from megatron_sdpo.planning import memory_ledger, stop_grace
from megatron_sdpo.planning.engine_class import EngineClass, engine_class
from megatron_sdpo.planning.kv_capacity import KVCapacity, kv_bytes_per_token
from megatron_sdpo.planning.memory_ledger import GIB, H100_USABLE_GIB, Ledger, LedgerInputs
from megatron_sdpo.planning.stop_grace import StopBudget

if TYPE_CHECKING:
    from megatron_sdpo.weights.plan import ModelSpec

# First rows parsed per data file that exists: enough to catch a wrong schema, cheap on a login node.
SCHEMA_CHECK_ROWS = 64
# The public config.json fields of the paper models (kept as data, in config.json's own form),
# for planning where the model directory is not on this machine (weights are downloaded by the job).
BUILTIN_ARCHS: dict[str, dict] = json.loads(
    (Path(__file__).resolve().parent.parent / "assets" / "builtin_archs.json").read_text()
)


@dataclass(frozen=True)
class Arch:
    """What the plan needs of a model's architecture: the weight plan's view of it."""

    source: str  # where the numbers came from
    spec: ModelSpec

    @property
    def params(self) -> int:
        """Parameter count (norm weights included; no biases in the supported models)."""
        s = self.spec
        attn = s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
        per_layer = (
            attn
            + 3 * s.hidden_size * s.ffn_hidden_size
            + 2 * s.hidden_size
            + 2 * s.head_dim * (s.num_heads + s.num_kv_heads)
        )
        return (
            s.num_layers * per_layer
            + s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
            + s.hidden_size
        )


def _model_dir(cfg: RunConfig) -> Path | None:
    from megatron_sdpo.models.tiny import VARIANTS, variant_dir
    from megatron_sdpo.models.tiny import is_complete as tiny_complete

    if cfg.model.path in VARIANTS:
        d = variant_dir(cfg.model.path)  # planning never builds; every variant has the shipped shape
        return d if tiny_complete(d) else variant_dir("tiny")
    from megatron_sdpo.models.packaged import PACKAGED_MODELS, is_complete, materialised_dir

    if cfg.model.path in PACKAGED_MODELS:
        # Planning never converts: a model not materialised yet uses the built-in table.
        d = materialised_dir(cfg.model.path)
        return d if is_complete(d) else None
    from megatron_sdpo.models import hub

    if hub.is_hub_id(cfg.model.path):
        return hub.cached_snapshot(cfg.model.path)  # planning never downloads
    p = Path(cfg.model.path)
    return p if (p / "config.json").is_file() else None


def resolve_arch(cfg: RunConfig) -> tuple[Arch | None, ModelSpec | None, list[str]]:
    """(Arch, the weight plan's ModelSpec, notes) from config.json or the built-in table;
    (None, None, [why]) for a model that is neither here nor in the table (a launch from a
    machine without the model: the checks that need the architecture are skipped)."""
    from transformers import AutoConfig

    from megatron_sdpo.weights.plan import ModelSpec

    notes: list[str] = []
    d = _model_dir(cfg)
    if d is not None:
        fields = json.loads((d / "config.json").read_text())
        source = f"{d / 'config.json'}"
    else:
        key = cfg.model.path.rstrip("/").lower()
        match = next((k for k in BUILTIN_ARCHS if key == k or key.endswith("/" + k.split("/")[-1])), None)
        if match is None:
            return (
                None,
                None,
                [
                    f"model.path {cfg.model.path!r}: no config.json there and no built-in architecture for it "
                    f"(built in: {', '.join(BUILTIN_ARCHS)}): model checks and the memory estimate are skipped"
                ],
            )
        fields = dict(BUILTIN_ARCHS[match])
        source = f"built-in table ({match})"
        notes.append(
            f"model directory {cfg.model.path!r} is not on this machine: architecture numbers from the built-in "
            f"table for {match}; the job reads the real config.json"
        )
    try:
        hf = AutoConfig.for_model(**fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"model config from {source}: {exc}") from None
    spec = ModelSpec.from_hf_config(hf)
    arch = Arch(source=source, spec=spec)
    return arch, spec, notes


@dataclass
class DataCheck:
    where: str  # domains.<d>.<split> (synthetic), else with .source or .extra_files
    source: str
    schema: str
    status: str  # "synthetic" | "ok (N rows checked)" | "missing"


def prepare_hint(cfg: RunConfig, source: str) -> str:
    """The command that writes a preset's missing data file (the paper sets' hub table)."""
    from megatron_sdpo.data.hub_table import BY_OUTPUT

    if Path(source).name not in BY_OUTPUT:
        return ""
    return f" (write it with `megatron-sdpo data prepare {cfg.name} --out {Path(source).parent}`)"


def check_data(cfg: RunConfig) -> tuple[list[DataCheck], list[str]]:
    """Schema of every data source the stages use; files that exist are parsed (first rows),
    missing files are warnings. A schema that cannot serve its domain is a DataError."""
    from megatron_sdpo.data.loaders import SCHEMAS, load_records

    checks, warnings = [], []
    used = dict.fromkeys(s.domain for s in cfg.stages)
    for domain in used:
        dcfg = cfg.domains[domain]
        for split, src in [("train", dcfg.train), *((f"eval.{k}", v) for k, v in dcfg.eval.items())]:
            where = f"domains.{domain}.{split}"
            if src.source == "synthetic":
                checks.append(DataCheck(where, src.source, "synthetic", "synthetic"))
                continue
            if src.schema not in SCHEMAS:
                raise DataError(
                    f"{where}.schema: unknown data schema {src.schema!r}; expected one of {', '.join(sorted(SCHEMAS))}"
                )
            schema_domain = SCHEMAS[src.schema][0]
            # Eval splits may hold other domains' sets (out-of-domain evaluation).
            if split == "train" and schema_domain is not None and schema_domain != domain:
                raise DataError(f"{where}: schema {src.schema!r} yields {schema_domain!r} records, not {domain!r}")
            for path in src.files():
                key = f"{where}.source" if path == src.source else f"{where}.extra_files"
                if not os.path.isfile(path):
                    checks.append(DataCheck(key, path, src.schema, "missing"))
                    warnings.append(f"{key}: data file not found here: {path}{prepare_hint(cfg, path)}")
                    continue
                recs = load_records(path, src.schema, limit=SCHEMA_CHECK_ROWS, seed=cfg.seed)
                if not recs:
                    raise DataError(f"{key}: {path} holds no records in schema {src.schema!r}")
                checks.append(DataCheck(key, path, src.schema, f"ok ({len(recs)} rows checked)"))
    return checks, warnings


@dataclass
class LaunchPlan:
    """Everything `--dry-run` reports (sizes in bytes)."""

    preset: str
    world_size: int
    world_source: str
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    rollout_engine: str
    rollout_tp: int
    rollout_tp_source: str
    replicas: int
    prompts_per_replica: int
    samples_per_step: int
    samples_per_dp_rank: int
    micro_batches: int
    arch: Arch | None
    ledger: Ledger | None  # None when the architecture is unknown here
    kv: KVCapacity | None  # vLLM's KV cache per replica; None without vLLM or an architecture
    gpu_memory_bytes: int  # usable device memory (what torch reports)
    data: list[DataCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    stop: StopBudget | None = None  # the grace a stop needs (planning/stop_grace.py); None without a ledger
    engine: EngineClass | None = None  # the vLLM class and its TP collectives (planning/engine_class.py)
    decode_steps: int = 0  # a step's engine decode steps, every answer at the length limit

    def memory_errors(self) -> list[str]:
        """One line per phase of the ledger over the device's usable memory."""
        return self.ledger.over_budget(self.gpu_memory_bytes) if self.ledger is not None else []

    def _data_summary(self) -> str:
        counts = {k: sum(d.status.split()[0] == k for d in self.data) for k in ("ok", "synthetic", "missing")}
        return (
            f"{len(self.data)} sources of the stages' domains: {counts['ok']} parsed with their schema, "
            f"{counts['synthetic']} synthetic, {counts['missing']} not on this machine"
        )

    def render(self) -> str:
        g = lambda b: f"{b / GIB:.2f}"
        lines = [
            f"dry run of {self.preset}: configuration, layout, data and memory checked; no weights loaded",
            f"ranks: {self.world_size} ({self.world_source})",
            f"trainer layout: TP={self.tp} PP={self.pp} DP={self.dp}"
            + (" (sequence parallel)" if self.sequence_parallel else ""),
            f"rollout: engine={self.rollout_engine}, vLLM TP={self.rollout_tp} ({self.rollout_tp_source}), "
            f"vLLM replicas={self.replicas}, {self.prompts_per_replica} prompts per replica per step",
            f"batch: {self.samples_per_step} samples per step, {self.samples_per_dp_rank} per DP rank, "
            f"{self.micro_batches} micro-batches per step",
        ]
        if self.arch is None:
            lines.append("model: architecture unknown on this machine; no memory estimate (see warnings)")
        else:
            lines += self._model_lines(self.arch, g)
        lines.append("data: " + self._data_summary())
        lines += [f"data: {d.where} {d.source} ({d.schema}): {d.status}" for d in self.data if d.status != "synthetic"]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _model_lines(self, arch: Arch, g) -> list[str]:
        lines = [
            f"model: {arch.params / 1e6:,.1f}M parameters, {arch.spec.num_layers} layers, "
            f"hidden {arch.spec.hidden_size}, vocab {arch.spec.vocab_size} (from {arch.source})",
        ]
        if self.ledger is not None:
            lines += self.ledger.render(self.gpu_memory_bytes)
        if self.kv is not None:
            lines += self.kv.lines()
        if self.engine is not None:
            lines.append(self.engine.line(arch.spec.num_layers, self.decode_steps, self.rollout_tp))
        if self.stop is not None:
            lines.append(self.stop.line())
        return lines


def world_size_from(requested: int | None) -> tuple[int, str]:
    """(world size, where it came from): --world-size, else WORLD_SIZE, else 1."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--world-size must be >= 1, got {requested}")
        return requested, "--world-size"
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return 1, "default; set WORLD_SIZE or --world-size"
    try:
        n = int(env)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={env!r} is not an integer") from None
    if n < 1:
        raise ConfigError(f"WORLD_SIZE={n} must be >= 1")
    return n, "WORLD_SIZE"


def plan(
    cfg: RunConfig,
    world_size: int | None = None,
    *,
    gpu_memory_gib: float = H100_USABLE_GIB,
    world_source: str | None = None,
) -> LaunchPlan:
    """The launch plan of `cfg` on `world_size` ranks (None: --world-size/WORLD_SIZE rules)."""
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig
    from megatron_sdpo.weights.plan import Layout

    if world_size is None:
        world_size, world_source = world_size_from(None)
    world_source = world_source or "given"
    megatron = backend_spec(cfg.backend.name).model_parallel
    m = cfg.backend.megatron
    tp, pp, sp = (m.tensor_parallel, m.pipeline_parallel, m.sequence_parallel) if megatron else (1, 1, False)
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} ({world_source}) is not divisible by backend.megatron.tensor_parallel * "
            f"pipeline_parallel = {tp} * {pp}"
        )
    layout = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp).resolve(world_size)
    arch, spec, unknown = resolve_arch(cfg)
    notes, warnings = (unknown, []) if arch is not None else ([], unknown)
    if megatron and spec is not None:
        Layout(tp=tp, pp=pp, vocab_divisor=cfg.backend.megatron.vocab_divisor).validate(spec)

    a = cfg.algorithm
    samples = a.prompts_per_step * a.group_size
    if samples < layout.dp:
        raise ConfigError(
            f"algorithm.prompts_per_step * group_size = {samples} samples per step is smaller than DP={layout.dp}"
        )
    per_dp = -(-samples // layout.dp)
    micro = -(-per_dp // cfg.backend.micro_batch_size)

    rtp, rtp_source = cfg.rollout.tensor_parallel_size, "rollout.tensor_parallel_size"
    if rtp < 1 or world_size % rtp:
        raise ConfigError(f"rollout tensor parallel size {rtp} ({rtp_source}) must divide the world size {world_size}")
    if arch is not None and arch.spec.num_heads % rtp:
        raise ConfigError(f"rollout tensor parallel size {rtp} must divide num_attention_heads={arch.spec.num_heads}")
    replicas = world_size // rtp
    per_replica = -(-a.prompts_per_step // replicas)
    if a.prompts_per_step % replicas:
        warnings.append(
            f"algorithm.prompts_per_step={a.prompts_per_step} does not split evenly over {replicas} vLLM replicas "
            f"(up to {per_replica} prompts each)"
        )

    data, data_warn = check_data(cfg)
    warnings += data_warn

    device_bytes = int(gpu_memory_gib * GIB)
    ledger = (
        memory_ledger.build(ledger_inputs(cfg, spec, layout.tp, layout.pp, layout.dp, rtp, device_bytes))
        if spec is not None
        else None
    )
    kv = kv_capacity(cfg, spec, ledger, rtp, replicas, per_replica, device_bytes)
    warnings += kv.warnings(replicas) if kv is not None else []
    engine = engine_class(spec) if spec is not None and cfg.rollout.engine in ("vllm", "auto") else None
    stop = (
        stop_budget(cfg, arch, ledger, kv, world_size, samples, engine, rtp)
        if arch is not None and ledger is not None
        else None
    )
    return LaunchPlan(
        preset=cfg.name,
        world_size=world_size,
        world_source=world_source,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        sequence_parallel=sp,
        rollout_engine=cfg.rollout.engine,
        rollout_tp=rtp,
        rollout_tp_source=rtp_source,
        replicas=replicas,
        prompts_per_replica=per_replica,
        samples_per_step=samples,
        samples_per_dp_rank=per_dp,
        micro_batches=micro,
        arch=arch,
        ledger=ledger,
        kv=kv,
        gpu_memory_bytes=device_bytes,
        data=data,
        notes=notes,
        warnings=warnings,
        stop=stop,
        engine=engine,
        decode_steps=decode_steps(cfg, kv.waves(kv.rollout_seqs) if kv is not None else 1),
    )


def stop_budget(
    cfg: RunConfig,
    arch: Arch,
    ledger: Ledger,
    kv: KVCapacity | None,
    world: int,
    samples: int,
    engine: EngineClass | None = None,
    rollout_tp: int = 1,
) -> StopBudget:
    """The grace a stop needs on this layout, before any step is measured: the planned step
    (every answer at max_model_len, the engine's TP collectives included), the save of one
    node's ranks, the refit after it."""
    a = cfg.algorithm
    extra = int(algorithm_spec(a.name).uses_teacher) + int(a.grpo.kl_coef > 0) + int(a.grpo.mini_batches > 1)
    # Full recompute runs every layer's forward again in backward: one more policy forward.
    extra += int(ledger.inputs.megatron and ledger.inputs.recompute == "full")
    engine_bytes = kv.engine_weight_bytes if kv is not None else 2 * arch.params
    waves = kv.waves(kv.rollout_seqs) if kv is not None else 1
    step_s, source = stop_grace.planned_step_seconds(
        params=arch.params,
        world=world,
        samples=samples,
        max_len=cfg.rollout.max_model_len,
        new_tokens=cfg.rollout.max_new_tokens,
        waves=waves,
        wave_seqs=min(kv.rollout_seqs, kv.sequences) if kv is not None else 0,
        kv_bytes_per_token=kv.per_token if kv is not None else 0,
        engine_weight_bytes=engine_bytes,
        extra_forwards=extra,
        collectives_s=engine.decode_seconds(arch.spec.num_layers, decode_steps(cfg, waves), rollout_tp)
        if engine
        else 0.0,
    )
    return stop_grace.planned_budget(
        step_s=step_s,
        step_source=source,
        node_bytes=max(ledger.node_save_bytes(stop_grace.ranks_per_node(world))),
        write_gib_s=cfg.checkpoint.write_gib_per_s,
        refit_bytes_per_rank=engine_bytes,
        offloaded=cfg.backend.offload_training_state,
    )


def decode_steps(cfg: RunConfig, waves: int) -> int:
    """A step's engine decode steps when every answer runs to the length limit."""
    return cfg.rollout.max_new_tokens * max(waves, 1)


def kv_capacity(
    cfg: RunConfig,
    spec: ModelSpec | None,
    ledger: Ledger | None,
    rollout_tp: int,
    replicas: int,
    prompts_per_replica: int,
    device_bytes: int,
) -> KVCapacity | None:
    """One vLLM replica's KV cache against a step's and an eval call's sequences."""
    if spec is None or ledger is None or not ledger.categories["kv_cache"]:
        return None
    e = cfg.eval
    samples = eval_samples_per_item(e.greedy, e.avg_k)
    records = -(-e.batch_size // replicas)
    return KVCapacity(
        per_token=kv_bytes_per_token(spec, rollout_tp),
        cache_bytes=ledger.categories["kv_cache"],
        engine_weight_bytes=ledger.categories["engine_weights"],
        device_bytes=device_bytes,
        utilization=cfg.rollout.gpu_memory_utilization,
        max_len=cfg.rollout.max_model_len,
        rollout_seqs=prompts_per_replica * cfg.algorithm.group_size,
        eval_seqs=records * samples,
        samples_per_record=samples,
        room_bytes=device_bytes - ledger.context_bytes,
        awake_other_bytes=max(ledger.phase_total(p) for p in ("rollout", "eval"))
        - ledger.categories["engine_weights"]
        - ledger.categories["kv_cache"],
    )


def teacher_seq(cfg: RunConfig) -> int:
    """A teacher row's most tokens: the re-prompt, cut to `max_context_tokens` (trainer/teacher.py,
    truncate_context_ids; without the cap the student's prompt room, max_model_len less the
    response), then the response, up to max_new_tokens (paper presets: 10,240 + 8,192 = 18,432
    against the student's 12,288)."""
    r, cap = cfg.rollout, cfg.algorithm.sdpo.context.max_context_tokens
    return (cap if cap is not None else r.max_model_len - r.max_new_tokens) + r.max_new_tokens


def ledger_inputs(
    cfg: RunConfig, spec: ModelSpec, tp: int, pp: int, dp: int, rollout_tp: int, device_bytes: int
) -> LedgerInputs:
    """The memory ledger's view of `cfg` on one rank of a TP x PP x DP layout."""
    m = cfg.backend.megatron
    model_parallel = backend_spec(cfg.backend.name).model_parallel
    sixteen = (m.params_dtype == "bfloat16") if model_parallel else cfg.model.dtype != "float32"
    a = cfg.algorithm
    with_teacher = algorithm_spec(a.name).uses_teacher
    riders = int(with_teacher) + int(a.grpo.kl_coef > 0)
    engine = "vllm" if cfg.rollout.engine in ("vllm", "auto") else "hf"
    return LedgerInputs(
        spec=spec,
        megatron=model_parallel,
        tp=tp,
        pp=pp,
        dp=dp,
        vocab_divisor=m.vocab_divisor,
        param_bytes=2 if sixteen else 4,
        distributed_optimizer=m.distributed_optimizer,
        with_teacher=with_teacher,
        with_reference=a.grpo.kl_coef > 0 or cfg.diagnostics.enabled,
        offload=cfg.backend.offload_training_state,
        engine=engine,
        rollout_tp=rollout_tp,
        engine_bytes=int(cfg.rollout.gpu_memory_utilization * device_bytes) if engine == "vllm" else 0,
        micro_batch_size=cfg.backend.micro_batch_size,
        seq=cfg.rollout.max_model_len,
        teacher_seq=teacher_seq(cfg) if with_teacher else 0,
        rollout_replicas=tp * pp * dp // rollout_tp,
        engine_graphs=engine == "vllm" and not cfg.rollout.enforce_eager,
        recompute=m.recompute if model_parallel else "none",
        fused_attention=m.transformer_impl != "local",
        sequence_parallel=m.sequence_parallel and model_parallel,
        activation_bytes=2 if sixteen else 4,
        fused_kl=cfg.kernel.fused_kl,
        riders=riders,
        bucket_bytes=cfg.rollout.bucket_bytes,
        device_bytes=device_bytes,
        response=cfg.rollout.max_new_tokens,
        loss_chunk_tokens=m.loss_chunk_tokens if model_parallel else 0,
        logit_counts=memory_ledger.logit_counts(
            distills=with_teacher,
            topk=a.sdpo.topk,
            is_clip=a.sdpo.is_clip is not None,
            riders=riders,
            # The HF backend and the whole-vocabulary losses (top-k picked from full logits, the
            # JSD from them at TP 1) take the micro-batch whole.
            chunked=model_parallel and m.loss_chunk_tokens > 0 and not (with_teacher and a.sdpo.topk is None),
        ),
        probe_rows=cfg.diagnostics.probe_n if cfg.diagnostics.enabled else 0,
    )


def preflight_errors(cfg: RunConfig, p: LaunchPlan) -> list[str]:
    """What `--dry-run --strict` (the cluster preflight, on the allocation) fails on, one line
    each: data files missing here, a model the ranks could not load, a memory plan over the GPU,
    an engine library of an untested release."""
    from megatron_sdpo.config.stack import check_stack, libraries_of
    from megatron_sdpo.models import hub
    from megatron_sdpo.models.packaged import PACKAGED_MODELS
    from megatron_sdpo.models.tiny import VARIANTS

    errors = [
        f"{d.where}: data file not found: {d.source}{prepare_hint(cfg, d.source)}"
        for d in p.data
        if d.status == "missing"
    ]
    path = cfg.model.path
    if path not in VARIANTS and path not in PACKAGED_MODELS:
        if hub.is_hub_id(path):
            try:
                hub.check_reachable(path)
            except UserError as exc:
                errors.append(str(exc))
        elif not (Path(path) / "config.json").is_file():
            errors.append(f"model.path {path!r}: no HF model directory there (no config.json) and not a hub id")
    try:
        check_stack(libraries_of(cfg.backend.name, cfg.rollout.engine))
    except UserError as exc:
        errors.append(str(exc))
    return errors + p.memory_errors()
