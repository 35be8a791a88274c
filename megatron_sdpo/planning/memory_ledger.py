"""One rank's device memory, phase by phase: the plan `run --dry-run` prints and fails on, and
the numbers the code's allocations are tested against (tests/unit/planning/test_memory_ledger.py with
memory_census.py on CPU; tests/gpu against torch.cuda.max_memory_allocated).

Categories are what stays allocated across a phase; transients are what one operation adds
on top while it runs. Every size comes from the weight plan's real shapes (weights/plan.py)
and the run's settings. The phases follow one trainer step (trainer/step.py) and the stage end:

  start           the base eval and the first rollout, before any optimizer step: engine awake;
                  with offload the backend moved its training state off before the engine
                  started (continual.py), without it the grad buffer and fp32 main params are
                  resident (Adam's moments come with the first step)
  rollout         engine awake (weights + KV cache); with offload, grads and optimizer on host
  train           engine asleep; forward/backward activations and logits of one micro-batch
  teacher_update  engine asleep; the EMA / copy's bucket buffers (teacher_state.py)
  refit           engine weights awake, KV cache not yet; the weight-sync buckets
  checkpoint      engine asleep, training state back on device; the HF export's gathered tensor
                  (the optimizer is gathered to DP rank 0 in host memory: `host_lines`)
  resume          engine asleep, the checkpoint loaded into the training state; then the state
                  goes off and the refit phase follows (continual.py)
  eval            engine awake; probe log-probs and gathered eval scores

Outside the phases: the CUDA context and NCCL's buffers, one per communicator the layout uses
(`context_items`, with NVLS off as slurm/_continual_body.sh sets it; vLLM's TP and DP groups
among them), vLLM's CUDA graph pool, and the caching allocator's fragmentation (usable memory is
what torch reports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from megatron_sdpo.rollout.base import REFIT_FREE_SHARE
from megatron_sdpo.weights.plan import REPLICATED, Layout, ModelSpec, plan

GIB = 1024**3
CATEGORIES = (
    "params",
    "grads",
    "optimizer",
    "teacher",
    "teacher_shadow",
    "reference",
    "engine_weights",
    "kv_cache",
    "activations",
    "logits",
)
TRANSIENTS = ("teacher_update", "hf_export", "refit_buckets", "probe_logprobs", "eval_gathers")
LABELS = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optim",
    "teacher": "teacher",
    "teacher_shadow": "shadow",
    "reference": "ref",
    "engine_weights": "vllm_w",
    "kv_cache": "kv",
    "activations": "act",
    "logits": "logits",
    "teacher_update": "+ema",
    "hf_export": "+export",
    "refit_buckets": "+refit",
    "probe_logprobs": "+probe",
    "eval_gathers": "+eval",
}
PHASES = ("start", "rollout", "train", "teacher_update", "refit", "checkpoint", "resume", "eval")
# What torch reports as an H100-80GB's memory.
H100_USABLE_GIB = 79.2
# The CUDA context with cuBLAS's workspaces, and the caching allocator's fragmentation.
CUDA_CONTEXT_BYTES = GIB // 2
FRAGMENTATION_BYTES = GIB
# One NCCL communicator's buffers with NVLS off: per channel and peer the Simple protocol's
# 4 MiB (NCCL_BUFFSIZE), LL128's 4.5 MiB and LL's 256 KiB, for up to 32 channels and the ring's
# two peers. (NVLS adds about 1 GiB more per communicator: off in slurm/_continual_body.sh.)
NCCL_COMM_BYTES = 32 * 2 * ((4 << 20) + (9 << 19) + (1 << 18))
# vLLM's CUDA graphs (rollout.enforce_eager false): captured in torch's graph pool, outside the
# sleep allocator, whose tags are weights and KV cache only, so they stay while the engine sleeps
# (vllm-project/vllm#45623 offloads them, not merged). vLLM's profiler estimates 0.36-0.44 GiB
# for its piecewise sizes up to 512 tokens on models of this size (its "Estimated CUDA graph
# memory" line); its older runner warned of 1-3 GiB per GPU: 1 GiB here.
VLLM_CUDA_GRAPH_BYTES = GIB
# Full recompute keeps only each layer's input: 2 bytes per token and hidden unit.
FULL_RECOMPUTE_UNITS = 2.0


@dataclass(frozen=True)
class LedgerInputs:
    """What the ledger needs of a run (memory_ledger.inputs_from_config builds it)."""

    spec: ModelSpec
    megatron: bool
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vocab_divisor: int = 128
    param_bytes: int = 4  # 2: bf16 params (fp32 main params in the optimizer)
    distributed_optimizer: bool = True
    with_teacher: bool = False
    with_reference: bool = False
    offload: bool = False  # grads and optimizer state off the device while the engine is awake
    engine: str = "hf"  # "vllm" holds its own weights and KV cache; "hf" generates with the policy
    rollout_tp: int = 1
    engine_bytes: int = 0  # vLLM: gpu_memory_utilization x device memory (weights + KV cache)
    kv_cache_bytes: int | None = None  # vLLM's kv_cache_memory_bytes when set (its CPU backend)
    micro_batch_size: int = 1
    seq: int = 512  # tokens per micro-batch row (max_model_len)
    # A teacher row's most tokens: its context (algorithm.sdpo.context.max_context_tokens, the cap
    # trainer/teacher.py truncates the re-prompt to) and the response (0: `seq`).
    teacher_seq: int = 0
    rollout_replicas: int = 1  # vLLM engines (data_parallel_size: one NCCL group when > 1)
    engine_graphs: bool = False  # vLLM captures CUDA graphs (rollout.enforce_eager false)
    recompute: str = "none"
    # Transformer Engine's fused attention keeps its output and an fp32 log-sum-exp per head;
    # megatron-core's local attention (backend.megatron.transformer_impl=local) its softmax.
    fused_attention: bool = True
    sequence_parallel: bool = False
    activation_bytes: int = 2  # bytes per activation element (the params dtype)
    fused_kl: bool = False
    riders: int = 0  # teacher / reference forwards riding the train step
    response: int = 0  # response tokens per row (rollout.max_new_tokens; 0: the whole row)
    loss_chunk_tokens: int = 0  # the loss's statistics over this many response tokens at a time (0: all)
    # The loss's vocabulary-wide tensors at their peak (logit_counts()).
    logit_counts: LogitCounts = None  # type: ignore[assignment]
    bucket_bytes: int = 64 << 20  # refit bucket cap
    device_bytes: int = 0  # usable device memory (0: unknown, the refit takes bucket_bytes)
    probe_rows: int = 8


@dataclass
class Ledger:
    """Bytes per category and transient, and which of them each phase holds."""

    inputs: LedgerInputs
    categories: dict[str, int]
    transients: dict[str, int]
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    def phase_total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak(self) -> tuple[str, int]:
        name = max(self.phases, key=self.phase_total)
        return name, self.phase_total(name)

    @property
    def checkpoint_bytes(self) -> int:
        """What one rank writes at a save: its policy and teacher shards, the fp32 shadow and the
        optimizer (main params and moments); the reference is the base model, not saved."""
        c = self.categories
        return sum(c[k] for k in ("params", "teacher", "teacher_shadow", "optimizer"))

    def node_save_bytes(self, ranks_per_node: int) -> list[int]:
        """Bytes each node writes at a save. Megatron (backends/megatron/checkpoint.py): DP rank 0
        of each TP x PP position writes the position's policy and teacher shards (replicated
        tensors come from DP rank 0 alone) and the position's whole optimizer ("fully_reshardable",
        gathered over DP: fp32 main params and both moments, whatever the params' dtype); every
        rank writes its pieces of the fp32 teacher shadow; rank 0 writes the policy as an HF
        directory in the model's dtype. Ranks run TP fastest, then DP, then PP (megatron-core's
        order), `ranks_per_node` to a node: the first node writes nearly all of it. The HF
        backend's rank 0 writes the whole checkpoint (checkpoint_bytes)."""
        i, c = self.inputs, self.categories
        world = i.tp * i.pp * i.dp
        out = [0] * max(1, -(-world // max(1, ranks_per_node)))
        if not i.megatron:
            out[0] = self.checkpoint_bytes
            return out
        elements = c["params"] // i.param_bytes  # this rank's share of the model
        position = c["params"] + c["teacher"] + 12 * elements
        for rank in range(world):
            first_dp = (rank // i.tp) % i.dp == 0
            out[rank // ranks_per_node] += c["teacher_shadow"] + (position if first_dp else 0)
        full_numel, _ = local_numel(i.spec, Layout(tp=1, pp=1, vocab_divisor=1))
        out[0] += i.param_bytes * full_numel
        return out

    @property
    def context_bytes(self) -> int:
        return sum(b for _, b in context_items(self.inputs))

    def over_budget(self, usable_bytes: int, context_bytes: int | None = None) -> list[str]:
        """One line per phase that does not fit `usable_bytes - context_bytes` (default: the
        layout's `context_items`)."""
        context_bytes = self.context_bytes if context_bytes is None else context_bytes
        room = usable_bytes - context_bytes
        return [
            f"memory plan: phase {p} needs {self.phase_total(p) / GIB:.1f} GiB per rank, more than the "
            f"{room / GIB:.1f} GiB usable ({usable_bytes / GIB:.1f} GiB less {context_bytes / GIB:.1f} GiB of context)"
            for p in PHASES
            if self.phase_total(p) > room
        ]

    def render(self, usable_bytes: int, context_bytes: int | None = None) -> list[str]:
        """The per-phase table `--dry-run` prints (GiB per rank; transients marked +)."""
        context_bytes = self.context_bytes if context_bytes is None else context_bytes
        cols = [c for c in (*CATEGORIES, *TRANSIENTS) if any(self.phases[p].get(c, 0) for p in PHASES)]
        width = 7
        lines = [
            "memory per rank by phase, GiB (" + ", ".join(f"{LABELS[c]}={c}" for c in cols if LABELS[c] != c) + ")",
            " ".join(["phase".ljust(14), *(LABELS[c].rjust(width) for c in cols), "total".rjust(width)]),
        ]
        for p in PHASES:
            row = self.phases[p]
            cells = [f"{row[c] / GIB:.2f}" if row.get(c) else "-" for c in cols]
            lines.append(
                " ".join(
                    [p.ljust(14), *(c.rjust(width) for c in cells), f"{self.phase_total(p) / GIB:.2f}".rjust(width)]
                )
            )
        zero = [c for c in (*CATEGORIES, *TRANSIENTS) if c not in cols]
        if zero:
            lines.append("none on the device in this run: " + ", ".join(zero))
        lines.append(
            f"a checkpoint writes {self.checkpoint_bytes / GIB:.2f} GiB per rank (the stop signal's grace "
            "must cover a step and this save)"
        )
        lines += self.host_lines()
        items = context_items(self.inputs)
        lines.append(f"context {context_bytes / GIB:.2f} GiB: " + ", ".join(f"{n} {b / GIB:.2f}" for n, b in items))
        name, peak = self.peak
        lines.append(
            f"peak: {name} {peak / GIB:.2f} GiB of {(usable_bytes - context_bytes) / GIB:.2f} GiB usable "
            f"({usable_bytes / GIB:.2f} GiB less {context_bytes / GIB:.2f} GiB of context)"
        )
        return lines

    def host_lines(self) -> list[str]:
        """Host memory of the optimizer's checkpoint format (checkpoint.py: "fully_reshardable",
        gathered over gloo): at a save DP rank 0 of each TP x PP position holds the whole
        optimizer of its position, the other ranks one bucket shard; at a resume every rank
        reads the whole of its position's optimizer before keeping its shard."""
        i = self.inputs
        if not (i.megatron and i.distributed_optimizer):
            return []
        whole = self.categories["optimizer"] * (i.dp if i.megatron and i.distributed_optimizer else 1)
        return [
            f"host memory of the optimizer at a save: {whole / GIB:.2f} GiB on DP rank 0 of each of the "
            f"{i.tp * i.pp} TP x PP positions; at a resume {whole / GIB:.2f} GiB on every rank"
        ]


def context_items(i: LedgerInputs) -> list[tuple[str, int]]:
    """What a rank's device holds outside the phases: the CUDA context, fragmentation, and one
    NCCL communicator's buffers per process group of more than one rank that the run uses:
    the world (barriers, the log-probs' gathers); megatron's TP group, the DP group and its
    context-parallel twin (DDP's reduce-scatter, the optimizer's all-gather), the
    model-parallel group (the gradient norm), the PP group and the embedding group (tied
    gradients across the first and last stage); vLLM's TP group (its NCCL communicator) and its
    DP group (rollout/vllm.py: `data_parallel_size` = replicas, synchronized over NCCL on GPU,
    `disable_nccl_for_dp_synchronization=False`). With vLLM's CUDA graphs their pool
    (`VLLM_CUDA_GRAPH_BYTES`), resident in every phase, the engine's sleep included."""
    comms = [("world", 1)]
    if i.megatron:
        comms += [
            ("tp", int(i.tp > 1)),
            ("dp", 2 * int(i.dp > 1)),
            ("model_parallel", int(i.tp * i.pp > 1)),
            ("pp", 2 * int(i.pp > 1)),
        ]
    if i.engine == "vllm":
        comms += [("vllm_tp", int(i.rollout_tp > 1)), ("vllm_dp", int(i.rollout_replicas > 1))]
    n = sum(k for _, k in comms)
    graphs = [("vllm_cuda_graphs", VLLM_CUDA_GRAPH_BYTES)] if i.engine == "vllm" and i.engine_graphs else []
    return [
        ("cuda_context", CUDA_CONTEXT_BYTES),
        ("fragmentation", FRAGMENTATION_BYTES),
        (f"nccl x{n} (" + "+".join(name for name, k in comms if k) + ")", n * NCCL_COMM_BYTES),
        *graphs,
    ]


def _split(kind: str, tp: int) -> int:
    return 1 if kind == REPLICATED else tp


def local_numel(spec: ModelSpec, layout: Layout) -> tuple[int, list[int]]:
    """(parameter elements of the largest pipeline stage on one TP rank, its tensors' sizes)."""
    best: list[int] = []
    for pp_rank in range(layout.pp):
        sizes = [math.prod(m.shape) // _split(m.kind, layout.tp) for m in plan(spec, layout, pp_rank)]
        if sum(sizes) > sum(best):
            best = sizes
    return sum(best), best


def activation_units(spec: ModelSpec) -> float:
    """Bytes a layer of the GPU path saves for backward per token, in units of the hidden size h
    (16-bit tensors count 2 per element, fp32 ones 4), with selective recompute of the core
    attention (the presets': its checkpoint keeps q, k and v; a fused kernel without recompute adds
    its output, the projection's input anyway, and a per-head log-sum-exp). Counted from what the
    code's layers keep, storage by storage (tests/distributed/test_activation_saves.py records
    them on CPU), with q = heads x head_dim, kv = kv_heads x head_dim, f = the gated MLP's
    intermediate; scales and rope tables per token are `activation_token_bytes`:

      both: the QKV linear's output 2(q + 2kv) (V, a view of it, goes into the attention, so the
        whole buffer stays), the rotated q and k 2q + 2kv (the attention's inputs), the output
        projection's input 2q; the MLP's FC1 input 2h and output 4f, SiLU's output 2f, the
        `x_linear + glu_linear_offset` copy 2f and FC2's input 2f (megatron's unfused glu:
        bias_activation_fusion is off in backends/megatron/model.py);
      pre-norm (Qwen3; Transformer Engine norms, fused into the next linear, keep their bf16
        input and an fp32 scale): the two norms' inputs 4h and their outputs, the QKV and FC1
        inputs, 4h; per-head QK-norm keeps its inputs: K is a view of the QKV output, Q a copy
        under GQA (the reshape after the split, megatron's attention.py) 2q;
      post-norm (Olmo; backends/megatron/olmo.py, the same modules on GPU): the QKV input 2h
        (the layer's input), each post-norm an fp32 copy of its input and the fp32 normalized
        value before the weight 8h (two of them), the full-width QK-norm the same 8q + 8kv.

    Korthikanti et al. 2022 count 34 for GPT (sec. 4.1); Qwen3-4B (q 1.6h, kv 0.4h, f 3.8h)
    61.2, Olmo-3-7B (MHA, f 2.6875h) 74.875."""
    h = spec.hidden_size
    q, kv, f = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
    units = 2 * (q + 2 * kv) + 2 * q + 2 * kv + 2 * q + 2 * h + 10 * f
    if spec.norm_placement == "post":
        units += 2 * h + 8 * h + 8 * h
    else:
        units += 4 * h + 2 * h
    if spec.qk_norm == "full":
        units += 8 * q + 8 * kv
    elif spec.qk_norm == "head" and spec.num_heads > spec.num_kv_heads:
        units += 2 * q
    return units / h


def activation_token_bytes(spec: ModelSpec, rows: int = 1) -> int:
    """The per-token bytes a layer saves that do not scale with h: the norms' fp32 scales (one per
    token and norm; per head for Qwen3's per-head QK-norm) and, in Olmo's QK-norm, the rope's fp32
    cos and sin tables of q and k, one per position, shared by the `rows` of a micro-batch."""
    if spec.norm_placement == "post":
        rope = 2 * 2 * 4 * spec.head_dim // rows if spec.ropes else 0
        return 4 * 4 + rope
    head = 4 * (spec.num_heads + spec.num_kv_heads) if spec.qk_norm == "head" else 0
    return 4 * 2 + head


def _activations(i: LedgerInputs, layers: int) -> int:
    """Bytes saved for backward by one micro-batch of max-length rows through `layers` layers:
    `activation_units` and `activation_token_bytes`, plus the attention scores (5 x heads x seq / h)
    without recompute. Full recompute keeps each layer's input, and in backward one layer at a
    time runs its forward again and holds what it saves until its backward: the selective count and
    the fused attention's fp32 log-sum-exp per head (its core attention is not checkpointed then),
    or with the local layers their attention scores; selective recompute of the local core
    attention holds one layer's scores in backward."""
    s = i.spec
    tokens = i.micro_batch_size * i.seq
    saved = activation_units(s) * s.hidden_size + activation_token_bytes(s, i.micro_batch_size)
    # The layer recomputed in backward keeps its core attention's saves until its own backward.
    scores = 4 * s.num_heads if i.fused_attention else 5.0 * s.num_heads * i.seq
    if i.recompute == "full":
        per_token = FULL_RECOMPUTE_UNITS * s.hidden_size * layers + saved + scores
    elif i.recompute == "selective":
        per_token = saved * layers + (0 if i.fused_attention else scores)
    else:
        per_token = (saved + 5.0 * s.num_heads * i.seq) * layers
    # The units count bf16 activations; fp32 params (activation_bytes 4) double them.
    shard = i.tp if i.sequence_parallel else 1
    return int(per_token * tokens * i.activation_bytes / 2 / shard)


@dataclass(frozen=True)
class LogitCounts:
    """The vocabulary-wide tensors alive at the peak of one micro-batch's loss, in three sizes:
    `full_rows` 16-bit [rows, seq, vocab / TP] (the model's logits over every position, their
    gradient and the layers' copies of both), `response` 16-bit [response tokens, vocab / TP]
    (each model's logits gathered at the response positions) and `fp32` [tokens, vocab / TP] over
    one chunk of response tokens (or all of them, `chunked` false)."""

    full_rows: int
    response: int
    fp32: int
    chunked: bool


def logit_counts(
    *, distills: bool, topk: int | None, is_clip: bool, riders: int, temperature: float = 1.0, chunked: bool = True
) -> LogitCounts:
    """What a megatron train step's loss holds at its peak, counted on CPU through every tensor
    the step creates (tools/loss_memory.py; tests/unit/planning/test_memory_ledger.py holds
    each count an upper bound at most 60% above the measured peak):

      full rows: 3, one more per rider beyond the first: the policy's logits in the schedule's
        [rows, seq] layout, their gradient and the gather's scatter into it; a rider's logits
        are alive through the policy's backward;
      response 16-bit: the policy's logits gathered at the response positions and one per rider;
      fp32 over the response tokens, whole: 3 for the policy's path, 2 per rider, the
        full-vocabulary JSD 8 more, the importance weight 1, a distillation temperature 2;
      chunked (step_loss.py), the same over one chunk of tokens and 1 more: the 16-bit gradients
        of the chunk's inputs while its backward recomputes it."""
    fp32 = (
        3
        + 2 * riders
        + (8 if distills and topk is None else 0)
        + (1 if distills and is_clip else 0)
        + (2 if distills and temperature != 1.0 else 0)
    )
    return LogitCounts(full_rows=3 + max(0, riders - 1), response=1 + riders, fp32=fp32 + int(chunked), chunked=chunked)


def _logits(i: LedgerInputs, vocab_local: int, padded_local: int) -> int:
    """The loss's vocabulary-wide tensors of one micro-batch at their peak (`LogitCounts`); the
    fused kernel path holds no logits. A teacher rider's full-row logits span its own row, up to
    `teacher_seq` tokens (its context and the response), not the student's."""
    c = i.logit_counts
    if i.fused_kl or c is None:
        return 0
    rows = i.micro_batch_size * i.seq
    response = i.micro_batch_size * (min(i.response, i.seq) if i.response else i.seq)
    fp32_tokens = min(response, i.loss_chunk_tokens) if (c.chunked and i.loss_chunk_tokens) else response
    b = i.activation_bytes  # the logits' dtype: the params'
    # The teacher's context is longer than the student's prompt: its row's extra tokens.
    teacher_extra = i.micro_batch_size * max(0, i.teacher_seq - i.seq) if (i.with_teacher and i.riders) else 0
    # The 16-bit tensors keep the padded columns (the slice to the real vocabulary is a view).
    return (
        c.full_rows * b * rows * padded_local
        + b * teacher_extra * padded_local
        + c.response * b * response * padded_local
        + c.fp32 * 4 * fp32_tokens * vocab_local
    )


def _refit_cap(i: LedgerInputs, held: int) -> int:
    """The refit's bucket cap as rollout/vllm.py sets it: at most 30% of what is free then."""
    if not i.device_bytes:
        return i.bucket_bytes
    return min(
        i.bucket_bytes, int(REFIT_FREE_SHARE * max(i.device_bytes - sum(b for _, b in context_items(i)) - held, 0))
    )


def build(i: LedgerInputs) -> Ledger:
    """The ledger of one rank (the largest pipeline stage)."""
    layout = Layout(tp=i.tp, pp=i.pp, vocab_divisor=i.vocab_divisor if i.megatron else 1)
    n, sizes = local_numel(i.spec, layout)
    dp_shard = i.dp if (i.megatron and i.distributed_optimizer) else 1
    p = i.param_bytes
    sixteen = p == 2
    # Adam's two moments in fp32, and fp32 main params for 16-bit params; the distributed
    # optimizer holds 1/DP of each bucket.
    optimizer = (8 + (4 if sixteen else 0)) * n // dp_shard
    # megatron's DDP reduces gradients in an fp32 buffer that lives across steps; the HF backend
    # frees its gradients after each step (only the train phase holds them).
    grads = 4 * n
    shadow = 4 * n // dp_shard if (i.with_teacher and sixteen) else 0
    # The backends slice the vocabulary padding off the logits: the widest rank's real share.
    padded_local = layout.padded_vocab(i.spec) // i.tp
    vocab_local = min(padded_local, i.spec.vocab_size)
    layers = i.spec.num_layers // i.pp
    full_numel, _ = local_numel(i.spec, Layout(tp=1, pp=1, vocab_divisor=1))
    _, padded_sizes = local_numel(i.spec, Layout(tp=1, pp=1, vocab_divisor=i.vocab_divisor if i.megatron else 1))
    probe_rows = min(i.probe_rows, i.micro_batch_size)
    engine_weights = 2 * full_numel // i.rollout_tp if i.engine == "vllm" else 0
    categories = {
        "params": p * n,
        "grads": grads,
        "optimizer": optimizer,
        "teacher": p * n if i.with_teacher else 0,
        "teacher_shadow": shadow,
        "reference": p * n if i.with_reference else 0,
        "engine_weights": engine_weights,
        "kv_cache": (i.kv_cache_bytes if i.kv_cache_bytes is not None else max(0, i.engine_bytes - engine_weights))
        if i.engine == "vllm"
        else 0,
        "activations": _activations(i, layers),
        "logits": _logits(i, vocab_local, padded_local),
    }
    transients = {
        # The sharded shadow rounds into the teacher one DDP bucket at a time: a bucket-sized
        # 16-bit gather buffer and this rank's shard of it (one bucket holds the stage's params);
        # unsharded (DP 1) it copies each piece in place.
        "teacher_update": (p * n + p * n // dp_shard) if (shadow and dp_shard > 1) else 0,
        # The HF export gathers one full tensor (all TP ranks' shards, vocabulary padded) and
        # slices the padding off: two copies of the largest tensor before it goes to host.
        "hf_export": 2 * p * max(padded_sizes),
        "refit_buckets": 0,  # below: it depends on what the refit phase holds
        # Stage-end probes (forward only): per logit the 16-bit output, its fp32 copy and its
        # log-softmax (10 bytes), plus one layer's working set; fp32 log-probs of every probe row.
        "probe_logprobs": 4 * i.probe_rows * i.seq
        + probe_rows * i.seq * 10 * vocab_local
        + _activations(replace(i, micro_batch_size=probe_rows), 1),
        # Eval (and reward) scores are gathered as objects on a gloo group (rollout/scoring.py):
        # through host memory, nothing on the device.
        "eval_gathers": 0,
    }
    if i.engine == "vllm":
        # One bucket of 16-bit weights held (at most 30% of the memory free at the refit,
        # rollout/vllm.py refit_bucket_bytes; a decoder layer is never split, so at least one
        # layer), while the export already produces the next tensor: up to three copies of the
        # largest (gathered, reordered, final).
        held = sum(_phases(i, categories, transients)["refit"].values())
        layer = 2 * sum(
            math.prod(m.shape)
            for m in plan(i.spec, Layout(vocab_divisor=layout.vocab_divisor), 0)
            if m.megatron.startswith("decoder.layers.0.")
        )
        transients["refit_buckets"] = max(_refit_cap(i, held), layer) + 3 * 2 * max(padded_sizes)
    return Ledger(i, categories, transients, _phases(i, categories, transients))


def _phases(i: LedgerInputs, c: dict[str, int], t: dict[str, int]) -> dict[str, dict[str, int]]:
    state = {k: c[k] for k in ("params", "teacher", "teacher_shadow", "reference")}
    training = {"grads": c["grads"] if i.megatron else 0, "optimizer": c["optimizer"]}
    awake = {} if i.offload else training
    engine = {"engine_weights": c["engine_weights"], "kv_cache": c["kv_cache"]}
    # Before the first optimizer step: DDP's grad buffer and the fp32 main params exist, Adam's
    # moments not yet; with offload the backend moved them off before the engine started.
    first = (
        {}
        if i.offload
        else {"grads": c["grads"] if i.megatron else 0, "optimizer": c["optimizer"] // 3 if i.param_bytes == 2 else 0}
    )
    return {
        "start": {**state, **first, **engine, "probe_logprobs": t["probe_logprobs"]},
        "rollout": {**state, **awake, **engine},
        "train": {**state, **training, "grads": c["grads"], "activations": c["activations"], "logits": c["logits"]},
        "teacher_update": {**state, **training, "teacher_update": t["teacher_update"]},
        "refit": {**state, **awake, "engine_weights": c["engine_weights"], "refit_buckets": t["refit_buckets"]},
        # With offload the trainer puts the engine to sleep around a checkpoint (trainer/step.py).
        "checkpoint": {**state, **training, **({} if i.offload else engine), "hf_export": t["hf_export"]},
        # The load puts the checkpoint into the training state with the engine asleep (offload)
        # or awake (without: nothing ever leaves the device).
        "resume": {**state, **training, **({} if i.offload else engine)},
        "eval": {**state, **awake, **engine, "probe_logprobs": t["probe_logprobs"], "eval_gathers": t["eval_gathers"]},
    }
