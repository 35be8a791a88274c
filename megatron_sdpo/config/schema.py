"""Typed run configuration. Every field here has the default that the `base` preset states too
(a test checks that the dataclass defaults and `presets/base.yaml` agree)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_sdpo.interfaces.domains import DOMAINS

EVAL_SPLITS = ("id", "ood_near", "ood_mid", "ood_far")


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" = the shipped tiny base model; else an HF model directory
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Extra keyword arguments of the tokenizer's chat template at every prompt it renders
    # (rollout, SDPO teacher re-prompt, evaluation), e.g. {enable_thinking: false} for Qwen3 as
    # the reference passes (`data.apply_chat_template_kwargs`). Empty: the template's defaults.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSource:
    source: str = "synthetic"  # "synthetic" or a path to a JSONL / JSON / parquet file
    schema: str = "records"  # loader schema for files (see megatron_sdpo.data.loaders)
    n: int = 512  # records drawn (synthetic) or kept (files); 0 = all (synthetic: every item of the split's space)
    # Synthetic only: replaces the instruction ending every generated prompt (a format hint a
    # pretrained chat model follows, e.g. smollm2_135m); null keeps the suite's own.
    instruction: str | None = None
    # Synthetic only: the generator's difficulty in [0, 1] (what it scales is in each domain's
    # module docstring, e.g. tool use: the share of arguments to compute rather than copy);
    # null keeps the suite's calibrated default for its tiny base.
    difficulty: float | None = None
    # Synthetic only: the domain's compact surface (fewer names and values, a subset of the full
    # space on the same train / id partition), small enough that `n: 0` evaluates it in seconds.
    compact: bool = False
    # Files only: further files of the same schema whose records follow `source`'s in the split
    # (`n` applies to each file), e.g. AIME 2024 + AIME 2025 as one in-domain math eval.
    extra_files: list[str] = field(default_factory=list)
    # Files only: keep the rows whose column holds one of the listed values (compared as text),
    # e.g. `where: {level: [1, 2]}` for MATH's two easiest levels.
    where: dict[str, list[str]] = field(default_factory=dict)
    # Files only: the share [lo, hi) of the file's questions, placed by a hash of the question
    # text: two splits of one file (train [0, 0.8], id [0.8, 1]) share no item and no question.
    part: list[float] | None = None

    def files(self) -> list[str]:
        """Every file this split reads: `source` and its `extra_files` (none when synthetic)."""
        return [] if self.source == "synthetic" else [self.source, *self.extra_files]


@dataclass
class Shot:
    """One worked example: a user turn and the assistant's reply."""

    user: str = ""
    assistant: str = ""


@dataclass
class DomainConfig:
    train: DataSource = field(default_factory=DataSource)
    eval: dict[str, DataSource] = field(default_factory=lambda: {s: DataSource(n=64) for s in EVAL_SPLITS})
    # Worked examples placed before every prompt of this domain (training and evaluation, student
    # and SDPO teacher) as earlier user / assistant chat turns: the answer format shown rather
    # than described, which a small instruct model follows (smollm2_135m) where it ignores a
    # one-line instruction.
    shots: list[Shot] = field(default_factory=list)


@dataclass
class StageConfig:
    domain: str = "math"
    steps: int = 40
    # Per-stage settings: partial mappings over the run's `algorithm`, `teacher` and `backend`
    # sections (e.g. `teacher: {ema_rate: 0.01}` for code), validated against those sections and
    # applied at the stage start (config/stages.py lists what may change between stages).
    algorithm: dict[str, Any] = field(default_factory=dict)
    teacher: dict[str, Any] = field(default_factory=dict)
    backend: dict[str, Any] = field(default_factory=dict)


@dataclass
class GRPOConfig:
    norm_by_std: bool = False  # the paper's GRPO: mean-only advantages
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0  # k3 KL to the base model; > 0 keeps a frozen reference copy
    tis_cap: float | None = 2.0  # truncated IS for rollout/trainer mismatch; null = off
    # Optimizer steps per rollout batch (whole prompt groups each); > 1: old log-probs of the
    # rollout-time policy are computed once, so the ratio moves and the clip acts.
    mini_batches: int = 1
    dual_clip: float | None = None  # dual-clip bound c > 1 for negative advantages; null = off


@dataclass
class ContextConfig:
    use_solution: bool = True
    use_feedback: bool = True  # master switch; feedback is used only in `feedback_domains`
    # The reference's policy: the environment's feedback only in code, and only for samples
    # without a successful sibling (its science and tool-use runs use no feedback at all).
    feedback_domains: list[str] = field(default_factory=lambda: ["code"])
    feedback_only_without_solution: bool = True
    sibling: Literal["first", "random"] = "first"  # which successful sibling is quoted
    success_threshold: float = 0.5
    max_solution_chars: int | None = None  # null: the whole sibling (the token cap applies)
    max_feedback_chars: int | None = 1000
    # The tokenized re-prompt is cut to this many tokens (the reference: 10,240), keeping its
    # end ("left": the instruction and the demonstration's end survive) or its start ("right":
    # the reference's `reprompt_truncation: right`).
    max_context_tokens: int | None = 10240
    truncation: Literal["left", "right"] = "left"
    strip_thinking: bool = True
    solution_template: str = "Here is a correct solution:\n{solution}\n\n"
    feedback_template: str = "Feedback on an earlier attempt:\n{feedback}\n\n"
    instruction: str = "Now answer the question correctly."
    # The whole message as one template with the fields {prompt}, {solution} and {feedback}
    # (each block already formatted, "" when absent): the reference's `reprompt_template`.
    # null: prompt + "\n\n" + blocks + `instruction`.
    reprompt_template: str | None = None
    # Math feedback: "all" (the verifier's, naming a wrong answer too) or "format" (only a
    # missing / empty \boxed{} or a truncated response, in the reference's words: its math
    # reward's default `format_feedback`). Used only where math is in feedback_domains.
    math_feedback: Literal["all", "format"] = "all"


@dataclass
class SDPOConfig:
    alpha: float = 0.5  # 0 forward KL(teacher||student), 1 reverse KL, else generalized JSD
    topk: int | None = None  # student top-k ids (+ tail bucket); null = full vocabulary
    add_tail: bool = True
    is_clip: float = 2.0
    variant: Literal["logits", "sampled"] = "logits"  # sampled: reverse KL on sampled tokens
    distill_cot: bool = True  # distill all response tokens, or only those after `</think>`
    reasoning_end: str = "</think>"
    # Share of response tokens dropped at random from the distillation loss (the paper code's
    # `mask_ratio`, a density ablation), drawn per step from the step's seed. 0: none dropped.
    mask_ratio: float = 0.0
    # Safeguards of the distillation (algorithms/safeguards.py; off by default). contrast_gate
    # s0: a prompt's distillation weight is min(1, std(group rewards) / s0), 0 the binary gate
    # (no reward contrast, no distillation); null off. agreement_mask: a token is distilled only
    # where the teacher's log-ratio over the student on the sampled token has the sign of the
    # sample's group-relative advantage (one more teacher forward a step).
    contrast_gate: float | None = None
    agreement_mask: bool = False
    hybrid_lambda: float = 0.5  # hybrid: lambda * GRPO + (1 - lambda) * SDPO
    context: ContextConfig = field(default_factory=ContextConfig)


@dataclass
class FilterGroupsConfig:
    # DAPO's dynamic sampling (rollout/group_filter.py): groups whose rewards all agree leave
    # the batch and up to `max_extra_rounds` more rounds of prompts refill it.
    enabled: bool = False
    max_extra_rounds: int = 2


@dataclass
class AlgorithmConfig:
    # What each name implies (teacher, advantages, mask): config/algorithm_spec.py.
    name: Literal["grpo", "sdpo", "stable_sdpo", "hybrid"] = "grpo"
    prompts_per_step: int = 16
    group_size: int = 8
    # Rows whose gradient is exactly 0 (GRPO: every advantage 0 and no KL term; SDPO: an empty
    # distillation mask) leave the forward and backward; the step is the same up to round-off
    # (algorithms/signal_rows.py).
    skip_zero_signal: bool = True
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sdpo: SDPOConfig = field(default_factory=SDPOConfig)


@dataclass
class TeacherConfig:
    # trust_region: lasgroup's trust-region teacher. Its weights stay as at the stage start (as
    # "frozen") and its logits are lerp(teacher, student, trust_region_mix) of the frozen
    # teacher's and the live student's on the teacher's context (the reference's
    # `teacher_regularization: trust-region`, whose `teacher_update_rate` is that coefficient).
    mode: Literal["ema", "frozen", "restart_freeze", "trust_region"] = "ema"
    ema_rate: float = 0.05  # mode ema: the teacher's EMA rate toward the student per step
    trust_region_mix: float = 0.05  # mode trust_region: the student's weight in the logit mix, one per run
    freeze_fraction: float = 0.4  # restart_freeze: restart every gamma * stage steps
    # At every stage start after the first: "none" keeps the EMA teacher (frozen and
    # restart_freeze copy the student by definition), "stage_start" copies the student into the
    # teacher (each of the reference's stage runs starts its teacher from the stage's model),
    # "base" loads the base model into the teacher. The first stage always starts from a copy.
    reset_at_stage: Literal["none", "base", "stage_start"] = "none"
    # Teacher initialisation (the paper code's `teacher_path` / `teacher_init_alpha`): at the
    # run's start the teacher is init_alpha * (this HF model directory) + (1 - init_alpha) *
    # student instead of a copy of the student. null: a copy.
    init_path: str | None = None
    init_alpha: float = 1.0


@dataclass
class RefitGuardConfig:
    # Stop when the mean |rollout - trainer| logprob of the sampled tokens exceeds this (a
    # refit that loaded the wrong weights gives O(1); fp32 on CPU gives ~1e-6, bf16 ~1e-2).
    # null: log the mismatch metrics only. Needs top_p 1 (the backends score at the rollout
    # temperature, not within the top-p nucleus).
    max_mismatch: float | None = 0.5


@dataclass
class RolloutConfig:
    # auto: vLLM where installed (single process or torchrun), else HF generate
    engine: Literal["auto", "vllm", "hf"] = "auto"
    # The engine's weights and arithmetic (auto: model.dtype). An fp32 trainer with a bf16 engine
    # (verl's and NeMo-RL's usual split) samples and evaluates ~3x faster on a CPU with AMX and
    # halves the engine's memory, but its tokens are not the fp32 engine's: answers, and so every
    # eval number, move (dev/LOG.md). The refit casts what the trainer sends.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Sampling temperature; the backends divide every model's logits by it too (policy, teacher,
    # reference; as verl and TRL do), so the loss sees the distribution the engine sampled from.
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    max_model_len: int = 512
    # Weight-sync bucket cap; on GPU also at most 30% of the memory free when the refit starts.
    bucket_bytes: int = 64 * 1024 * 1024
    gpu_memory_utilization: float = 0.5
    # vLLM on GPU: what sleep releases while the trainer runs. 2 drops the engine's weights (every
    # refit re-sends all of them); 1 copies them to host memory and back at every step.
    sleep_level: Literal[1, 2] = 2
    # vLLM sampling seeds. request: one per prompt from (seed, its index in the step): samples
    # are the same under any replica layout (layout-invariant), but vLLM samples seeded
    # requests one at a time (and leaves FlashInfer's top-p). engine: the engine is reseeded
    # from (seed, stage, step, replica) at every generate and samples in one batch. auto:
    # engine on GPU, request on CPU.
    seeding: Literal["auto", "request", "engine"] = "auto"
    # vLLM tensor parallelism per engine replica (independent of the trainer's); under torchrun
    # world / tensor_parallel_size replicas each generate their share of a step's prompts.
    tensor_parallel_size: int = 1
    # torch intra-op threads while the engine generates (and, for vLLM, reloads weights; null:
    # the process's count). Decoding is many small ops; on a busy CPU one thread avoids OpenMP
    # spin-wait at each of them (dev/LOG.md, tools/bench_rollout.py).
    threads: int | None = None
    # vLLM: reuse a prompt's KV blocks across its n samples and across prompts with a common
    # prefix (the chat template's system text); reset at every refit.
    prefix_caching: bool = True
    # vLLM: false compiles the decoder (torch.compile; CUDA graphs too on GPU), which pays
    # start-up once (cached across runs) for faster decode steps; true runs it eagerly.
    enforce_eager: bool = False
    guard: RefitGuardConfig = field(default_factory=RefitGuardConfig)


@dataclass
class FP8Config:
    recipe: Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8"] = "none"
    fp8_format: Literal["e4m3", "hybrid"] = "hybrid"


@dataclass
class MegatronConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    recompute: Literal["none", "selective", "full"] = "none"
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    # The vocabulary is padded to a multiple of this, whatever the TP size (so a checkpoint
    # resumes under another TP); tensor_parallel must divide it. SmolLM2-135M's 3 KV heads allow
    # TP 1 or 3 only: TP 3 needs e.g. 384 (49,152 = 128 x 384, so no padding either way).
    vocab_divisor: int = 128
    # The loss's per-token statistics over vocab-sharded logits run over this many response
    # tokens at a time, recomputed in backward: their fp32 [tokens, vocab / TP] tensors are alive
    # for one chunk (memory_ledger.py, "logits"). 0: the whole micro-batch at once.
    loss_chunk_tokens: int = 1024
    fp8: FP8Config = field(default_factory=FP8Config)
    # The layers' implementation. auto: Transformer Engine's on a CUDA machine (a run there without
    # it is refused, not silently moved to the local layers), megatron-core's local modules on
    # CPU. local: the local modules everywhere (unfused attention: the plan counts the softmax
    # probabilities it keeps); transformer_engine: TE's, refused where it is not installed.
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"


@dataclass
class LRScheduleConfig:
    # Restarts at every stage: linear warmup from 0, then decay over the stage's steps.
    style: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class BackendConfig:
    name: Literal["hf", "megatron"] = "hf"
    lr: float = 1e-4
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 64  # samples per micro-batch
    # Train-step forwards on packed rows (no padding; backends/varlen.py, and THD packed
    # sequences in megatron: backends/megatron/packed.py) instead of the padded
    # [B, longest prompt + longest response] rectangle. null: on, except with megatron on a
    # model whose layers take the padded layout only (Olmo), where true is a ConfigError.
    packing: bool | None = None
    # Row capacity of the HF backend's packed layout in tokens (0: one row per micro-batch;
    # megatron packs one row per micro-batch, its THD attention needs no bound). SDPA and eager
    # attention with a block-diagonal mask cost row length squared: on the tiny run rows of 256
    # took 0.71x the padded step, one row per micro-batch 2.6x (tools/bench_pack.py).
    pack_row_tokens: int = 256
    # In the packed layout, samples with identical prompts (a GRPO/SDPO group) share one copy of
    # the prompt: each response attends to it and to itself through an explicit mask, so the
    # prompt's tokens are run once per group instead of once per sample. HF backend only (THD
    # segments cannot state that mask). null: on wherever packing is with the HF backend; true
    # without packing or with megatron is a ConfigError.
    share_prompts: bool | None = None
    stage_start: Literal["weights_only", "keep_optimizer"] = "weights_only"
    # Gradients and optimizer state leave the device after each optimizer step and the teacher
    # update, and come back at the next train step: the rollout engine's weights and KV cache
    # never share the device with them (as verl's and NeMo-RL's offload around rollout; the
    # phases in memory_ledger.py). Costs a host round trip of those bytes per step.
    offload_training_state: bool = False
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class RewardConfig:
    # Code: one sandbox per batch that forks per program (processes killed and directories wiped
    # between programs) instead of one sandbox process per program: ~3x cheaper, same isolation.
    batched_code: bool = True


@dataclass
class KernelConfig:
    impl: Literal["auto", "reference", "chunked", "triton"] = "auto"
    fused_kl: bool = False  # full-vocab SDPO through the fused linear KL (hidden states)
    chunk_tokens: int = 1024
    chunk_vocab: int = 8192


def eval_samples_per_item(greedy: bool, avg_k: int) -> int:
    """Answers the eval draws per item: k for avg@k (avg_k > 0, not greedy), else one."""
    return 1 if greedy or avg_k <= 0 else avg_k


@dataclass
class EvalConfig:
    greedy: bool = True
    avg_k: int = 0  # > 0 and greedy false: avg@k, k samples per item, mean accuracy
    # Sampling of avg@k (the reference validates at 0.6 / 0.95 with n = 4). null temperature:
    # the rollout's.
    temperature: float | None = None
    top_p: float = 1.0
    max_new_tokens: int = 32
    batch_size: int = 64
    # Steps within every stage (1-based) after which the stage's own domain is evaluated on its
    # in-domain split, into that step's metrics record (`eval/<domain>/id`): how fast a method
    # specializes, beside the stage-end eval matrix. The stage's last step is the matrix's row.
    at_steps: list[int] = field(default_factory=list)
    # A directory shared by runs whose base row is the same (outputs/base_rows.py): the row is
    # read from there when a run with the same model, items and settings wrote it, else evaluated
    # and written there. `study` sets it to OUT/base_rows. null: every run evaluates its own.
    base_row_cache: str | None = None


@dataclass
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "megatron_sdpo"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    quiet: bool = False
    plots: bool = True


@dataclass
class CheckpointConfig:
    save_every: int = 10  # steps; 0 = only at stage ends
    keep_last: int = 2
    # What one node's filesystem writes, for the time a stop's save needs (planning/stop_grace.py).
    write_gib_per_s: float = 1.0


@dataclass
class DiagnosticsConfig:
    enabled: bool = True
    probe_n: int = 8  # probe prompts per domain for response drift
    response_drift: bool = True
    svd_rank: int = 16
    collapse_repeat_threshold: float = 0.5  # share of responses with repeated format tokens
    # Alarm when the mean response length falls below this share of its value at the stage start
    # (null: off).
    collapse_min_length_ratio: float | None = 0.6
    # Alarm when the mean training reward of the last 3 steps falls below this share of its mean
    # over the stage's first 3 steps, and by at least 0.1 (null: off).
    collapse_min_reward_ratio: float | None = 0.5
    # Every N steps of a stage (its first step, then every N; 0: never) score the sampled
    # responses under the teacher too: how much more likely the teacher (with its context) finds
    # rewarded vs unrewarded responses than the student did. One extra teacher forward pass of
    # the whole batch on those steps, which training does not need: sampled, not every step.
    teacher_signal_every: int = 5
    stop_on_collapse: bool = False
    # CPU threads of each stage's detached drift job (drift_jobs.py; 0: this node's CPUs divided
    # by its trainer processes).
    threads: int = 0
    # Overlap of each stage's top-1% update with the top-1% principal weights (largest entries of
    # the rank-svd_rank reconstruction) of the policy it started from: one more SVD per matrix.
    principal_overlap: bool = True
    # Prompts per dataset embedded once per run for the OOD distance table (RBF-MMD between each
    # stage's training set and each eval set, run_dir/ood_distance.json; 0: off). Needs
    # response_drift (the embedder).
    ood_distance_n: int = 128
    # Every N training steps and at each stage's last step (0: never): the policy's relative
    # parameter change against the stage start and the base, norms only, to drift/steps.jsonl.
    # One weight export (a collective, as for the rollout engine) and a read of both references.
    drift_every: int = 0


@dataclass
class LaunchConfig:
    executor: Literal["local", "slurm"] = "local"
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str = ""
    account: str = ""
    time: str = "04:00:00"
    container_image: str = ""
    # How long a collective waits for a rank before the job fails (torch.distributed's process
    # group timeout; its own default is 10 minutes under NCCL). It must exceed the longest stretch
    # one rank works while the others wait (the main rank's checkpoint writes and eval scoring;
    # the stage-end drift diagnostics run detached, drift_jobs.py).
    distributed_timeout_minutes: float = 30.0


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig(domain=d) for d in DOMAINS])
    domains: dict[str, DomainConfig] = field(default_factory=lambda: {d: DomainConfig() for d in DOMAINS})
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
