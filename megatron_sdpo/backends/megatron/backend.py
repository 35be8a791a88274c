"""MegatronBackend: the backend seam (interfaces/backend.py) on megatron-core GPTModel (TP x PP x DP).

Policy and teacher are two GPTModels with the same layout; only the policy is wrapped in
megatron DDP and owned by the (distributed) optimizer. Every forward goes through
`get_forward_backward_func()`, so the same code runs with and without pipeline parallelism.
Logits stay vocab-sharded: the loss inputs are computed from shards by `vocab_parallel`.

Frozen models the loss needs (the teacher on its privileged prompts, the reference on the
student's) ride along in the student's own forward-backward schedule: each micro-batch runs
them forward (no grad) next to the student, and under pipeline parallelism their hidden states
travel with the student's through the same P2P sends, stacked along the batch dimension. So
the teacher costs no extra schedule, no extra pipeline bubble, and only one micro-batch's
teacher logits (vocab-sharded) are alive at a time.

Scaling is owned by `_loss_adapter` alone: the LossFn returns sum(token terms) / normalizer
for its micro-batch (normalizer global over all DP ranks); megatron's schedule divides the
returned loss by the number of micro-batches and DDP averages gradients over DP, so the adapter
multiplies by (micro-batches x DP size). The gradient is then that of the global loss, whatever
the micro-batch count or DP size.

Packed rows (`packing`, on by default where the layers take them): each micro-batch's samples
end to end in one row, megatron's THD packed-sequence params marking where each sample starts
(packed.py, batching.py). Transformer Engine's varlen attention runs them on GPU; on CPU the
local layer spec's core attention does. Under pipeline parallelism every row of a step (the
riders' too) has the step's common width, so hidden states still share the P2P buffers. Olmo's
layers take the padded layout only (their attention applies per-layer ropes itself).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_sdpo.backends import vocab_parallel as vp
from megatron_sdpo.backends.common import (
    MetricSums,
    blend_sources,
    check_backend_args,
    checked_batch,
    dp_slice,
    named_model,
    reduce_metrics,
    resolve_pad_id,
)
from megatron_sdpo.backends.megatron import batching, heads
from megatron_sdpo.backends.megatron.model import ModelOptions, build_model, supports_packing, weight_layout
from megatron_sdpo.backends.megatron.parallel import (
    ParallelConfig,
    group_device,
    init_distributed,
    initialize,
    launch_device,
)
from megatron_sdpo.backends.megatron.step_loss import StepLoss
from megatron_sdpo.backends.offload import StateOffload, needs_training_state
from megatron_sdpo.config.backend_spec import BACKENDS
from megatron_sdpo.errors import ConfigError, require
from megatron_sdpo.interfaces.backend import REQUIRES, Backend, LossFn, SequenceBatch
from megatron_sdpo.interfaces.blend import TeacherBlend, blend_
from megatron_sdpo.interfaces.distillation import TopkSource
from megatron_sdpo.interfaces.schedule import LRSchedule
from megatron_sdpo.stopwatch import Stopwatch
from megatron_sdpo.weights.plan import ModelSpec
from megatron_sdpo.weights.transport import export_hf, load_hf

_TEACHER_OUTPUTS = frozenset(
    {"teacher_logits", "teacher_logprobs", "fused_kl", "topk_logprobs", "teacher_topk_logprobs"}
)


def _hf_tensors(model_path: str):
    """A lazy name -> tensor mapping over an HF directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model_path {model_path!r} has no *.safetensors files")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                where[k] = f

    class _Lazy(dict):
        def __missing__(self, key):
            if key not in where:
                raise KeyError(key)
            with safe_open(str(where[key]), framework="pt") as h:
                return h.get_tensor(key)

        def __contains__(self, key):
            return key in where

    return _Lazy()


class MegatronBackend(Backend):
    """Megatron-core backend. Launch one process per rank (torchrun) or call from a single
    process (a world of one is created). `micro_batch_size` counts samples per micro-batch;
    `packing`: packed rows (None: wherever the model's layers take them; module docstring)."""

    # Logits stay vocab-sharded over TP: the backend picks the top-k ids from the shards and
    # hands the loss their log-probabilities ("topk_logprobs").
    topk_source: TopkSource = BACKENDS["megatron"].topk_source

    def __init__(
        self,
        model_path: str,
        *,
        lr: float,
        micro_batch_size: int,
        lr_schedule: LRSchedule = LRSchedule(),
        parallel: ParallelConfig = ParallelConfig(),
        options: ModelOptions = ModelOptions(),
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float = 1.0,
        seed: int = 0,
        with_teacher: bool = True,
        with_reference: bool = False,
        distributed_optimizer: bool = True,
        pad_token_id: int | None = None,
        device: torch.device | str | None = None,
        fused_kl: str = "kernel",
        logit_temperature: float = 1.0,
        packing: bool | None = None,
        loss_chunk_tokens: int = 1024,
    ):
        require("megatron.core", "cpu", "the megatron backend")
        from transformers import AutoConfig

        check_backend_args(model_path, lr=lr, micro_batch_size=micro_batch_size, logit_temperature=logit_temperature)
        # Divides every model's logits (policy, teacher, reference): the rollout temperature, so
        # trainer log-probs are those of the distribution the engine sampled from.
        self.logit_temperature = float(logit_temperature)
        if fused_kl not in ("kernel", "shards"):
            raise ConfigError(f"fused_kl={fused_kl!r}; expected 'kernel' or 'shards'")
        # How a loss's "fused_kl" is computed: "kernel" from final hidden states and the sharded
        # LM head (no logits, `heads`), "shards" from vocab-sharded logits (`vocab_parallel`).
        self.fused_kl = fused_kl
        if loss_chunk_tokens < 0:
            raise ConfigError(
                f"loss_chunk_tokens={loss_chunk_tokens}; expected >= 0 (0: the whole micro-batch at once)"
            )
        # Response tokens the logits path's loss statistics take at a time (step_loss.py).
        self.loss_chunk_tokens = int(loss_chunk_tokens)
        if not torch.cuda.is_available():
            from megatron_sdpo.backends.megatron import cpu

            cpu.install()
        if not dist.is_initialized() and "RANK" not in os.environ:
            from megatron_sdpo.backends.megatron.launch import free_port

            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        init_distributed()
        # Every tensor the backend makes lives on `device` (the models' device); buffers handed
        # to collectives on `comm_device` (NCCL: the same GPU, gloo: the CPU).
        self.device = torch.device(device) if device is not None else launch_device()
        self.comm_device = group_device()
        # Time in the teacher's forward inside train_step, reported as "time/teacher_forward".
        self.teacher_clock = Stopwatch(self.device)
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        self.layout = initialize(parallel, seed=seed)
        self.dp_size = self.layout.dp
        from megatron.core import parallel_state as ps

        self._ps = ps
        hf_config = AutoConfig.from_pretrained(model_path)
        self.spec = ModelSpec.from_hf_config(hf_config)
        if packing and not supports_packing(self.spec):
            raise ConfigError(
                f"backend.packing=true: {self.spec.arch}'s layers take the padded layout only; set it to false or null"
            )
        self.packing = supports_packing(self.spec) if packing is None else bool(packing)
        self.options = options
        self.wlayout = weight_layout(self.layout.tp, self.layout.pp, options)
        self.model_path = str(model_path)
        self.micro_batch_size = micro_batch_size
        # Row length multiple (the sequence split over TP under SP; 16 tokens a rank under FP8).
        self.seq_multiple = batching.seq_multiple(
            self.layout.tp, options.sequence_parallel, fp8=options.precision.fp8 is not None
        )
        self.lr, self.weight_decay, self.betas, self.eps, self.grad_clip = (
            lr,
            weight_decay,
            tuple(betas),
            eps,
            grad_clip,
        )
        self.distributed_optimizer = distributed_optimizer
        lr_schedule.check()
        self.lr_schedule = lr_schedule
        self.step = 0
        self.pad_token_id = resolve_pad_id(pad_token_id, hf_config)

        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.vocab_start, self.vocab_width = vp.shard_bounds(
            self.wlayout.padded_vocab(self.spec), self.spec.vocab_size, self.layout.tp, self.tp_rank
        )
        if self.vocab_width == 0:
            raise ConfigError("model.vocab_divisor is so large that a TP rank holds only padded vocabulary rows")

        # The checkpoint is read once; teacher and reference start as copies of the policy.
        self.policy = self._build(_hf_tensors(self.model_path), trainable=True)
        self.teacher = self._frozen_copy(self.policy) if with_teacher else None
        self.reference = self._frozen_copy(self.policy) if with_reference else None
        self._wrap_policy()
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler(None)
        # bf16 params: the EMA teacher lives in an fp32 shadow of its shards (teacher_state.py).
        self.teacher_fp32 = None
        self._offload = StateOffload(self.device)
        if self.teacher is not None and self.options.precision.params == "bfloat16":
            from megatron_sdpo.backends.megatron.teacher_state import FP32TeacherShadow

            self.teacher_fp32 = FP32TeacherShadow(
                self._params("teacher"), self._params("policy"), self.optimizer, self.policy
            )

    # ------------------------------------------------------------------ setup
    def _build(self, hf, trainable: bool):
        model = build_model(self.spec, self.options)
        load_hf(model, hf, self.spec, self.wlayout, self.tp_rank, self.pp_rank)
        if not trainable:
            model.requires_grad_(False)
        model.eval()  # dropout is 0; eval keeps every forward deterministic
        return model

    @torch.no_grad()
    def _frozen_copy(self, source):
        """A model of `source`'s layout holding its weights, without gradients."""
        model = build_model(self.spec, self.options)
        for dst, src in zip(model.parameters(), source.parameters(), strict=True):
            dst.copy_(src)
        return model.requires_grad_(False).eval()

    def _wrap_policy(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        config = self.policy.config
        self.policy = DistributedDataParallel(config=config, ddp_config=ddp_config, module=self.policy)
        config.no_sync_func = self.policy.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = None

    def _make_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            # Each param group reads its lr bounds from here, not from the scheduler.
            min_lr=self.lr * self.lr_schedule.min_lr_ratio,
            weight_decay=self.weight_decay,
            adam_beta1=self.betas[0],
            adam_beta2=self.betas[1],
            adam_eps=self.eps,
            clip_grad=self.grad_clip if self.grad_clip and self.grad_clip > 0 else 0.0,
            bf16=self.options.precision.params == "bfloat16",
            params_dtype=self.options.precision.dtype,
            use_distributed_optimizer=self.distributed_optimizer,
        )
        return get_megatron_optimizer(cfg, [self.policy])

    def _make_scheduler(self, total_steps: int | None):
        """megatron's OptimizerParamScheduler for a stage of `total_steps` steps (None: hold the
        peak after warmup); same values as LRSchedule.lr."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s = self.lr_schedule
        style = s.style if total_steps else "constant"
        # megatron needs decay steps > warmup steps even when nothing decays.
        decay = max(total_steps or 0, s.warmup_steps + 1)
        self._sched_total = total_steps
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=self.lr,
            min_lr=self.lr * s.min_lr_ratio,
            lr_warmup_steps=s.warmup_steps,
            lr_decay_steps=decay,
            lr_decay_style=style,
            start_wd=self.weight_decay,
            end_wd=self.weight_decay,
            wd_incr_steps=decay,
            wd_incr_style="constant",
        )

    def _model(self, name: str):
        return named_model(name, {"policy": self.policy, "teacher": self.teacher, "reference": self.reference})

    # ------------------------------------------------------------------ batches
    def _micro(
        self, batch: SequenceBatch, T: int, prompts: list[list[int]], local: list[int], riders: tuple = ()
    ) -> tuple[list[dict], int]:
        """This DP rank's micro-batches (batching.micro_batch_dicts) and their row length S."""
        return batching.micro_batch_dicts(
            batch,
            T,
            prompts,
            local,
            riders,
            size=self.micro_batch_size,
            equal=self.layout.pp > 1,
            packed=self.packing,
            multiple=self.seq_multiple,
            pad_id=self.pad_token_id,
            device=self.device,
        )

    def _rows_per_micro_batch(self) -> int:
        """Rows of a micro-batch (the pipeline's P2P buffers): one packed row, or a row per sample."""
        return 1 if self.packing else self.micro_batch_size

    # ------------------------------------------------------------------ forward pieces
    def _response_shard(self, logits: torch.Tensor, rows: batching.Rows) -> torch.Tensor:
        """[r, S, V/tp] model output of `rows` (r = 1 packed) -> [b, T, width] fp32 logits /
        logit_temperature predicting response tokens, padded vocabulary columns cut off."""
        return self.fp32_logits(rows.select(logits)[..., : self.vocab_width])

    def fp32_logits(self, shard: torch.Tensor) -> torch.Tensor:
        """16-bit logit shard -> fp32 logits / logit_temperature (what every statistic reads)."""
        return vp.tempered(shard.float(), self.logit_temperature)

    def _stats(self, shard: torch.Tensor, targets: torch.Tensor, needs: frozenset) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if "logprobs" in needs:
            out["logprobs"] = vp.logprobs(shard, targets, self.vocab_start, self.tp_group)[0]
        if "entropy" in needs:
            out["entropy"] = vp.entropy(shard, self.tp_group)
        if "logits" in needs:
            if self.layout.tp > 1:
                raise ConfigError(
                    "the loss asks for full-vocabulary 'logits' but tp > 1 keeps them vocab-sharded; "
                    "use a loss that requires 'fused_kl' (or top-k computed from shards)"
                )
            out["logits"] = shard
        return out

    def _forward_only(self, model, micro: list[dict], S: int, collect) -> list:
        """Run `model` forward over the micro-batches; `collect(mb, logits)` runs on the last
        stage and its results are returned in micro-batch order (empty on other stages)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iter, m):
            mb = next(data_iter)
            out = m(mb["rows"].tokens, mb["rows"].positions, None, packed_seq_params=mb["rows"].packed)

            def reduce(output):
                return output.new_zeros(()), {"value": collect(mb, output)}

            return out, reduce

        with torch.no_grad():
            store = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(micro),
                model=[model],
                num_microbatches=len(micro),
                seq_length=S,
                micro_batch_size=self._rows_per_micro_batch(),
                forward_only=True,
            )
        return [d["value"] for d in store] if self._ps.is_pipeline_last_stage() else []

    # ------------------------------------------------------------------ public API
    def logprobs(self, batch: SequenceBatch, *, model: str = "policy") -> torch.Tensor:
        """[B, T] fp32 logprobs of the responses under `model`, on every rank (padding columns 0).
        The teacher reads `teacher_prompt_ids` where given."""
        batch, T = checked_batch(batch)
        local = dp_slice(len(batch), self.layout.dp, self.dp_rank)
        prompts = batch.teacher_prompts() if model == "teacher" else batch.prompt_ids
        micro, S = self._micro(batch, T, prompts, local)

        def collect(mb, logits):
            shard = self._response_shard(logits, mb["rows"])
            return vp.logprobs(shard, mb["rows"].targets, self.vocab_start, self.tp_group)[0][: mb["n_real"]]

        parts = self._forward_only(self._model(model), micro, S, collect)
        rows = torch.zeros(len(batch), T, dtype=torch.float32, device=self.comm_device)
        if parts:
            rows[local] = torch.cat(parts).to(self.comm_device)
        # Every rank gets every row: the last stages hold disjoint DP slices, the rest zeros.
        rows = rows.contiguous()
        dist.all_reduce(rows)
        if self.layout.tp > 1:
            rows /= self.layout.tp  # each TP rank of a last stage contributed the same rows
        mask = batch.tensors["response_mask"]
        # Returned where the caller keeps its batch tensors.
        return rows.to(mask.device) * mask

    @needs_training_state
    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the global batch. Returns {"loss", "grad_norm", "skipped",
        "samples", <loss metrics summed over the batch>}, identical on every rank."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch, T = checked_batch(batch)
        requires = frozenset(loss_fn.requires)
        unknown = requires - REQUIRES
        if unknown:
            raise ConfigError(f"loss requires unknown outputs {sorted(unknown)}; known: {sorted(REQUIRES)}")
        if "ref_logprobs" in requires and self.reference is None:
            raise ConfigError("the loss needs 'ref_logprobs' but the backend has no reference model")
        normalizer = loss_fn.global_normalizer(batch.tensors).float().to(self.device)
        local = dp_slice(len(batch), self.layout.dp, self.dp_rank)
        riders: list[tuple[str, Any, list]] = []  # (name, megatron model, its prompts)
        if requires & _TEACHER_OUTPUTS:
            riders.append(("teacher", self._model("teacher"), batch.teacher_prompts()))
        if "ref_logprobs" in requires:
            riders.append(("reference", self.reference, batch.prompt_ids))
        micro, S = self._micro(batch, T, batch.prompt_ids, local, tuple(r[2] for r in riders))
        from_hidden = "fused_kl" in requires and self.fused_kl == "kernel"
        if from_hidden:
            heads.check_requires(requires)
        # The schedule divides by the micro-batch count and DDP averages over DP: undo both.
        losses = StepLoss(self, loss_fn, requires, riders, normalizer, scale=float(len(micro) * self.layout.dp))
        adapter = losses.from_hidden if from_hidden else losses.from_logits
        policy = self.policy.module
        first, last = self._ps.is_pipeline_first_stage(), self._ps.is_pipeline_last_stage()

        def step(data_iter, m):
            mb = next(data_iter)
            if riders and not first:
                # The received tensor stacks [student | rider 1 | ...] along the batch dim.
                parts = policy.decoder.input_tensor.chunk(1 + len(riders), dim=1)
                policy.set_input_tensor(parts[0])
                for (_, model, _), part in zip(riders, parts[1:], strict=True):
                    model.set_input_tensor(part.detach())
            # On the last stage of the fused path every model stops at its final norm.
            hidden = heads.hidden_only(m, *(r[1] for r in riders)) if from_hidden else contextlib.nullcontext()
            with hidden:
                with torch.no_grad():
                    rider_out = []
                    for (name, model, _), rows in zip(riders, mb["rider_rows"], strict=True):
                        with self.teacher_clock.measure() if name == "teacher" else contextlib.nullcontext():
                            rider_out.append(model(rows.tokens, rows.positions, None, packed_seq_params=rows.packed))
                out = m(mb["rows"].tokens, mb["rows"].positions, None, packed_seq_params=mb["rows"].packed)
            if not last and riders:
                out = torch.cat([out, *rider_out], dim=1)
            return out, partial(adapter, mb, rider_out)

        self.policy.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.teacher_clock.take()  # only this step's teacher forwards count
        self.policy.train()
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro),
            model=[self.policy],
            num_microbatches=len(micro),
            seq_length=S,
            micro_batch_size=self._rows_per_micro_batch() * (1 + len(riders)),
            forward_only=False,
        )
        self.policy.eval()
        for _, model, _ in riders:
            model.set_input_tensor(None)
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.step += 1
            self.scheduler.step(1)
        out = self._reduce_metrics(losses.sums, grad_norm, ok, len(batch))
        out["lr"] = float(lr)
        # This rank's seconds in the teacher's forward (the trainer books them as teacher time).
        out["time/teacher_forward"] = self.teacher_clock.take()
        return out

    def _reduce_metrics(self, sums: MetricSums, grad_norm, ok: bool, n: int) -> dict[str, float]:
        """Combine metric shares over the last stages' DP ranks (sum / max / min per
        `metric_reduce`); every rank gets the result."""
        last = self._ps.is_pipeline_last_stage() and self.tp_rank == 0
        # Only last stages ran the loss: share the metric names so every rank joins each reduce.
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(sums.values) if last else None)
        names: list[str] = next((x for x in gathered if x is not None), ["loss"])
        out = reduce_metrics(sums if last else None, names, self.comm_device)
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["skipped"] = 0.0 if ok else 1.0
        out["samples"] = float(n)
        return out

    def export_weights(self, *, model: str = "policy") -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs, gathered over TP and broadcast over PP, one at a time.
        Collective: every rank of the model-parallel grid must consume it in step."""
        return export_hf(
            self._model(model),
            self.spec,
            self.wlayout,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            pp_rank=self.pp_rank,
            device=self.device,
        )

    def _params(self, name: str) -> list[torch.Tensor]:
        m = self._model(name)
        return list(getattr(m, "module", m).parameters())

    @needs_training_state
    def blend_teacher(self, blend: TeacherBlend) -> None:
        """Apply a teacher update (interfaces/blend.py) shard-locally: the teacher has the
        policy's layout. With bf16 params it is blended from the optimizer's fp32 main params
        into the fp32 shadow and rounded once (teacher_state.py)."""
        if blend.is_identity:
            return
        reference = None if self.reference is None else self._params("reference")
        sources = blend_sources(blend, [p.detach() for p in self._params("policy")], reference)
        if sources is None:
            self.teacher_from_base()
        elif self.teacher_fp32 is not None:
            self.teacher_fp32.blend(
                blend, self._params("teacher"), self._params("policy"), self.optimizer, reference=reference
            )
        else:
            blend_(self._params("teacher"), sources, blend)

    @needs_training_state
    def fp32_weights(self, model: str = "policy") -> list[torch.Tensor]:
        """This rank's fp32 truth of `model`'s local shards, in `parameters()` order: the
        teacher's EMA shadow with bf16 params (else its params; NaN where another DP rank owns
        the shadow's elements under the distributed optimizer); for the policy, the params
        with fp32 params, else the optimizer's fp32 main values scattered into full-shape
        tensors (elements this DP rank does not own under the distributed optimizer are NaN)."""
        if model == "teacher" and self.teacher_fp32 is not None:
            return self.teacher_fp32.full()
        if model != "policy" or self.options.precision.params != "bfloat16":
            return [p.detach() for p in self._params(model)]
        from megatron_sdpo.backends.megatron.teacher_state import main_params

        out = []
        mains, _ = main_params(self.optimizer, self._params("policy"))
        for p, (main, a, b) in zip(self._params("policy"), mains, strict=True):
            full = torch.full((p.numel(),), float("nan"), dtype=torch.float32, device=p.device)
            full[a:b] = main
            out.append(full.view(p.shape))
        return out

    def teacher_from_base(self) -> None:
        """Teacher <- the base model (the HF directory this backend was built from)."""
        teacher = self._model("teacher")
        load_hf(teacher, _hf_tensors(self.model_path), self.spec, self.wlayout, self.tp_rank, self.pp_rank)
        if self.teacher_fp32 is not None:
            self.teacher_fp32.resync(self._params("teacher"))

    def configure_optimizer(self, *, lr: float, weight_decay: float, grad_clip: float, lr_schedule: LRSchedule) -> None:
        """New optimizer settings (a stage's): they take effect at the next set_lr_schedule (lr,
        schedule, weight decay: megatron's scheduler sets them every step) and step (clipping)."""
        if lr <= 0:
            raise ConfigError(f"lr must be > 0, got {lr}")
        lr_schedule.check()
        self.lr, self.weight_decay, self.grad_clip, self.lr_schedule = lr, weight_decay, grad_clip, lr_schedule
        for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            opt.config.clip_grad = grad_clip if grad_clip and grad_clip > 0 else 0.0
            for g in opt.param_groups:
                # The param groups carry their own lr bounds (see _make_optimizer).
                g["max_lr"], g["min_lr"] = lr, lr * lr_schedule.min_lr_ratio
                for key in ("start_wd", "end_wd"):  # decayed groups' own weight-decay bounds
                    if g.get(key):
                        g[key] = weight_decay

    # ------------------------------------------------------------------ offload
    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """Adam's moments and the fp32 main params of every (chained) optimizer."""
        out: list[torch.Tensor] = []
        for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            inner = getattr(opt, "optimizer", opt)
            out += [p for g in inner.param_groups for p in g["params"]]
            out += [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        return out

    def offload_training_state(self) -> int:
        """Grad buffers and optimizer state off the device until the next train step (offload.py);
        the weights (views of DDP's param buffer under the distributed optimizer) stay."""
        grads = [buf.grad_data for buf in [*self.policy.buffers, *getattr(self.policy, "expert_parallel_buffers", [])]]
        return self._offload.offload(self._optimizer_tensors(), grads, keep=self._params("policy"))

    def reload_training_state(self) -> None:
        self._offload.reload()

    @property
    def training_state_offloaded(self) -> bool:
        return self._offload.active

    @needs_training_state
    def reset_optimizer(self) -> None:
        """Fresh optimizer state (moments, step count) over the same DDP-wrapped policy; the
        LR schedule restarts at step 0 of the same stage length. With bf16 params the fp32 main
        params carry over (a fresh optimizer would re-create them from the bf16 weights)."""
        old = self.optimizer
        self.optimizer = self._make_optimizer()
        if self.options.precision.params == "bfloat16":
            from megatron_sdpo.backends.megatron.teacher_state import main_params

            with torch.no_grad():
                params = self._params("policy")
                for (dst, _, _), (src, _, _) in zip(
                    main_params(self.optimizer, params)[0], main_params(old, params)[0], strict=True
                ):
                    dst.copy_(src)
        self.scheduler = self._make_scheduler(self._sched_total)

    def set_lr_schedule(self, total_steps: int | None) -> None:
        """Restart the LR schedule at step 0 of a stage of `total_steps` optimizer steps."""
        self.lr_schedule.check(total_steps)
        self.scheduler = self._make_scheduler(total_steps)

    @needs_training_state
    def save(self, path: str, *, extra: dict | None = None) -> None:
        """Atomic dist_checkpointing save of policy, teacher, optimizer, RNG, step and `extra`."""
        from megatron_sdpo.backends.megatron.checkpoint import save

        save(self, path, extra=extra)

    @needs_training_state
    def load(self, path: str, *, weights_only: bool = False) -> dict:
        """Load a checkpoint written by `save` (any DP size); returns its `extra` dict."""
        from megatron_sdpo.backends.megatron.checkpoint import load

        return load(self, path, weights_only=weights_only)
