"""HF transformers backend: a causal LM policy, its teacher copy and torch DDP over gloo/NCCL.

Every rank receives the same global `SequenceBatch`; the backend takes its data-parallel slice,
splits it into micro-batches, and owns every normalization factor: the loss normalizer is
computed once over the *global* batch (so it needs no all-reduce), each micro-batch contributes
`sum(per-token) / normalizer`, and the loss is multiplied by the DP world size because DDP
averages gradients. Loss, grad norm and updated weights therefore do not depend on the number
of ranks or micro-batches (tests/unit/backends and tests/distributed check this).

Dropout is disabled (the model stays in eval mode while training): the importance ratios of
GRPO/SDPO compare the trainer's distribution with the sampler's, which must be the same
function of the weights.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron_sdpo.backends.common import (
    MetricSums,
    blend_sources,
    check_backend_args,
    checked_batch,
    dp_sizes,
    dp_slice,
    named_model,
    reduce_metrics,
    resolve_pad_id,
)
from megatron_sdpo.backends.hf import checkpoint as hf_checkpoint
from megatron_sdpo.backends.hf.logits import ResponseLogits, layer_masks, masked_token_logprobs, topk_logprobs
from megatron_sdpo.backends.hf.teacher import HFTeacher
from megatron_sdpo.backends.offload import StateOffload, needs_training_state
from megatron_sdpo.backends.varlen import pack_varlen
from megatron_sdpo.config.backend_spec import BACKENDS
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import REQUIRES, Backend, LossFn, SequenceBatch
from megatron_sdpo.interfaces.blend import TeacherBlend
from megatron_sdpo.interfaces.distillation import DistillationSpec, TopkSource, distillation_of
from megatron_sdpo.interfaces.layout import pack, token_entropy, token_logprobs
from megatron_sdpo.interfaces.schedule import LRSchedule
from megatron_sdpo.models.hf_model import load_causal_lm

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TEACHER_NEEDS = {"teacher_logits", "teacher_logprobs", "topk_logprobs", "teacher_topk_logprobs"}


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class HFBackend(Backend):
    """Policy + teacher (+ optional frozen reference) transformers causal LMs trained with AdamW.

    `micro_batch_size` counts samples per forward/backward on one rank. With
    torch.distributed initialized, the policy is wrapped in DDP (gloo on CPU). With `packing`
    every forward runs the micro-batch's samples packed into rows of at most `pack_row_tokens`
    tokens (0: one row) without padding (`backends.varlen`); with `share_prompts` (None: when
    packing) samples with identical prompts (a group) share one copy of the prompt as well."""

    # Full [B, T, V] logits are at hand: a top-k loss picks its ids from them.
    topk_source: TopkSource = BACKENDS["hf"].topk_source

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        lr: float,
        lr_schedule: LRSchedule = LRSchedule(),
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        micro_batch_size: int,
        seed: int = 0,
        with_teacher: bool = True,
        with_reference: bool = False,
        pad_token_id: int | None = None,
        packing: bool = True,
        pack_row_tokens: int = 256,
        share_prompts: bool | None = None,
        logit_temperature: float = 1.0,
        teacher_init: tuple[str, float] | None = None,
        teacher_logit_mix: float | None = None,
    ):
        check_backend_args(model_path, lr=lr, micro_batch_size=micro_batch_size, logit_temperature=logit_temperature)
        # Divides every model's logits (policy, teacher, reference): the rollout temperature.
        self.logit_temperature = float(logit_temperature)
        self.model_path = str(model_path)
        self.dtype = _resolve_dtype(dtype)
        self.lr, self.weight_decay = lr, weight_decay
        self.betas = cast(tuple[float, float], tuple(betas))
        lr_schedule.check()
        self.lr_schedule = lr_schedule
        # (optimizer steps taken in the stage, stage length or None): see set_lr_schedule.
        self._sched: tuple[int, int | None] = (0, None)
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        if pack_row_tokens < 0:
            raise ConfigError(f"pack_row_tokens must be >= 0 (0: one row per micro-batch), got {pack_row_tokens}")
        # Packed rows (backends.varlen) instead of the padded rectangle; see _run.
        self.packing, self.pack_row_tokens = bool(packing), int(pack_row_tokens)
        if share_prompts and not self.packing:
            raise ConfigError("share_prompts needs packing: the padded layout has one row per sample")
        # None: wherever packing is.
        self.share_prompts = self.packing if share_prompts is None else bool(share_prompts)
        self.seed = seed
        self.step = 0

        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

        self.policy = load_causal_lm(self.model_path, self.dtype)
        self.policy.eval()
        self.pad_token_id = resolve_pad_id(pad_token_id, self.policy.config)
        if self.share_prompts:
            self._check_mask_support(self.policy.config)

        self.device = next(self.policy.parameters()).device
        self._offload = StateOffload(self.device)
        # The teacher (model, fp32 shadow, trust-region mix, forward clock): hf/teacher.py.
        self.teacher_state = (
            HFTeacher(self._frozen_copy(), self.device, logit_mix=teacher_logit_mix) if with_teacher else None
        )
        self.reference = self._frozen_copy() if with_reference else None
        # State updated by small steps lives in fp32 whatever the model dtype: with a bf16/fp16
        # model AdamW updates fp32 master copies of the policy (cast into the model after each
        # step); at lr 1e-5 most bf16 weights would otherwise never change.
        self._masters: list[torch.Tensor] | None = None
        if self.dtype != torch.float32:
            self._masters = [self._fp32_copy(p, p.requires_grad) for p in self.policy.parameters()]
        if teacher_init is not None and self.teacher_state is not None:
            # The paper code's teacher initialisation: checkpoint * alpha + student * (1 - alpha).
            path, alpha = teacher_init
            self.teacher_from_path(path)
            self.blend_teacher(TeacherBlend.init(alpha))

        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.dp_size = self.world
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._head = ResponseLogits(self.policy, self.logit_temperature)
        # In-process vLLM initializes a world-1 process group of its own: DDP only when there
        # is data parallelism to do.
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self._train_module: nn.Module = DDP(self._head)
        else:
            self._train_module = self._head
        self.optimizer = self._make_optimizer()

    @property
    def teacher(self) -> nn.Module | None:
        """The teacher model its forwards run (None without a teacher)."""
        return None if self.teacher_state is None else self.teacher_state.model

    @property
    def _teacher(self) -> HFTeacher:
        return cast(HFTeacher, named_model("teacher", {"teacher": self.teacher_state}))

    def _teacher_seconds(self) -> float:
        """Seconds in the teacher's forwards since the last call (0 without a teacher)."""
        return 0.0 if self.teacher_state is None else self.teacher_state.clock.take()

    # ------------------------------------------------------------------ setup helpers
    def _frozen_copy(self) -> nn.Module:
        m = copy.deepcopy(self.policy)
        m.requires_grad_(False)
        m.eval()
        return m

    @staticmethod
    def _fp32_copy(p: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return p.detach().to(torch.float32).clone().requires_grad_(requires_grad)

    @needs_training_state
    def fp32_weights(self, model: str = "policy") -> list[torch.Tensor]:
        """The fp32 truth of `model`'s parameters, in `parameters()` order: the policy's master
        weights / the teacher's EMA shadow when the model runs in bf16 or fp16, else the
        parameters themselves. Live tensors: copy them to keep them."""
        if model == "policy" and self._masters is not None:
            return self._masters
        if model == "teacher":
            return self._teacher.fp32_weights()
        return [p.detach() for p in self._model(model).parameters()]

    def _optimized_params(self) -> list[torch.Tensor]:
        """What AdamW updates: the fp32 masters, or the fp32 policy parameters."""
        return self._masters if self._masters is not None else list(self.policy.parameters())

    def _make_optimizer(self) -> torch.optim.Optimizer:
        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        for p in self._optimized_params():
            if p.requires_grad:
                # Norm gains and biases are not decayed (the usual AdamW practice).
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)

    def _model(self, name: str) -> nn.Module:
        return named_model(name, {"policy": self.policy, "teacher": self.teacher, "reference": self.reference})

    def _micro_batches(self, idx: list[int]) -> list[list[int]]:
        mbs = self.micro_batch_size
        return [idx[i : i + mbs] for i in range(0, len(idx), mbs)]

    @staticmethod
    def _check_mask_support(config) -> None:
        impl = getattr(config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            raise ConfigError(
                f"share_prompts needs sdpa or eager attention (an explicit 4D mask); the model uses "
                f"{impl!r}: set backend.share_prompts=false"
            )

    def _attention_mask(
        self, allowed: torch.Tensor | None, positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The shared layout's [R, 1, W, W] bool mask (True = attend), windowed per layer type
        (hf/logits.layer_masks), as the attention implementation takes a prepared 4D mask: SDPA
        a bool mask, eager an additive one."""
        if allowed is None:
            return None
        masks = layer_masks(allowed, positions, self.policy.config)
        if self.policy.config._attn_implementation == "sdpa":
            return masks
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        additive = lambda m: zero.masked_fill(~m, torch.finfo(self.dtype).min)
        return {k: additive(m) for k, m in masks.items()} if isinstance(masks, dict) else additive(masks)

    # ------------------------------------------------------------------ forward
    def _run(
        self,
        module: nn.Module,
        prompts: list[list[int]],
        responses: list[list[int]],
        T: int,
        hidden_only: bool = False,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ([b, T, V] fp32 logits predicting each response token, or with hidden_only their
        [b, T, H] hidden states; [b, T] response ids), through the packed layout with
        `packing`, else the padded one; with `keep` ([b, T] bool) the first output holds only
        those positions ([N, V] / [N, H], ResponseLogits)."""
        if not isinstance(module, (ResponseLogits, nn.parallel.DistributedDataParallel)):
            module = ResponseLogits(module, self.logit_temperature)
        if self.packing:
            vb = pack_varlen(
                prompts,
                responses,
                response_len=T,
                pad_id=self.pad_token_id,
                row_tokens=self.pack_row_tokens,
                share_prompts=self.share_prompts,
                device=self.device,
            )
            mask = self._attention_mask(vb.attention_mask, vb.position_ids)
            return module(vb.input_ids, mask, vb.position_ids, vb.hidden_index, hidden_only, keep=keep), vb.response_ids
        pk = pack(prompts, responses, response_len=T, pad_id=self.pad_token_id)
        return module(pk.input_ids, pk.attention_mask, pk.position_ids, T, hidden_only, keep=keep), pk.response_ids

    def _logprobs(
        self, module: nn.Module, prompts: list[list[int]], responses: list[list[int]], T: int
    ) -> torch.Tensor:
        """[b, T] fp32 log-probs of the response tokens, 0 on padding columns: the output
        projection and the log-softmax run on the real tokens only (T is the longest response
        of the batch; on the tiny math workload a third of the columns are real)."""
        keep = (
            torch.arange(T, device=self.device) < torch.tensor([len(r) for r in responses], device=self.device)[:, None]
        )
        logits, targets = self._run(module, prompts, responses, T, keep=keep)
        return masked_token_logprobs(logits, targets, keep)

    def _teacher_logits(self, mb: SequenceBatch, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's [b, T, V] logits of `mb`'s responses after its teacher prompts (call
        under no_grad) and the target ids; with the trust-region teacher, lerp(teacher, student,
        mix) of both models' logits on that same input (linear, so the temperature division
        commutes with it)."""
        prompts = mb.teacher_prompts()
        mix = self._teacher.logit_mix
        t_logits, targets = self._run(self._teacher.model, prompts, mb.response_ids, T)
        if mix is not None:
            s_logits, _ = self._run(self.policy, prompts, mb.response_ids, T)
            t_logits = torch.lerp(t_logits, s_logits, mix)
        return t_logits, targets

    def _fused_kl(self, mb: SequenceBatch, T: int, module: nn.Module, spec: DistillationSpec) -> torch.Tensor:
        """[b, T] per-token distillation loss from hidden states through the fused kernel: the
        [b, T, V] logits of neither model are ever built."""
        from megatron_sdpo_kernels import ChunkSizes, fused_linear_kl

        if self._teacher.logit_mix is not None:
            raise ConfigError(
                "the trust-region teacher mixes logits, which the fused kernel never builds: set kernel.fused_kl=false"
            )
        heads = [cast(Any, m).get_output_embeddings() for m in (self.policy, self._model("teacher"))]
        if any(h.bias is not None for h in heads):
            raise ConfigError("kernel.fused_kl needs an LM head without bias")
        h_s, _ = self._run(module, mb.prompt_ids, mb.response_ids, T, hidden_only=True)
        with torch.no_grad(), self._teacher.clock.measure():
            h_t, _ = self._run(self._model("teacher"), mb.teacher_prompts(), mb.response_ids, T, hidden_only=True)
        mask = mb.tensors[spec.mask_key] > 0
        b, _, H = h_s.shape
        per_token = fused_linear_kl(
            h_s.reshape(b * T, H),
            h_t.reshape(b * T, -1),
            heads[0].weight,
            heads[1].weight,
            alpha=spec.alpha,
            temperature=spec.temperature * self.logit_temperature,
            mask=mask.reshape(-1),
            impl=spec.kernel_impl,
            chunk_sizes=ChunkSizes(tokens=spec.chunk_tokens, vocab=spec.chunk_vocab),
        )
        return per_token.view(b, T)

    def _outputs(
        self, mb: SequenceBatch, T: int, requires: frozenset, module: nn.Module, loss_fn: LossFn | None = None
    ) -> dict[str, torch.Tensor]:
        """Computes exactly the quantities in `requires` for one micro-batch (policy with grad
        when called under grad mode; teacher/reference always under no_grad)."""
        unknown = set(requires) - REQUIRES
        if unknown:
            raise ConfigError(f"loss requires unknown outputs {sorted(unknown)}; known: {sorted(REQUIRES)}")
        out: dict[str, torch.Tensor] = {}
        if "fused_kl" in requires:
            out["fused_kl"] = self._fused_kl(mb, T, module, distillation_of(loss_fn, "fused_kl"))
        topk = requires & {"topk_logprobs", "teacher_topk_logprobs"}
        if requires & {"entropy", "logits"} or topk:
            logits, targets = self._run(module, mb.prompt_ids, mb.response_ids, T)
            if "logits" in requires:
                out["logits"] = logits
            if "logprobs" in requires:
                out["logprobs"] = token_logprobs(logits, targets)
            if "entropy" in requires:
                out["entropy"] = token_entropy(logits)
        elif "logprobs" in requires:
            out["logprobs"] = self._logprobs(module, mb.prompt_ids, mb.response_ids, T)
        if requires & _TEACHER_NEEDS == {"teacher_logprobs"} and self._teacher.logit_mix is None:
            with torch.no_grad(), self._teacher.clock.measure():
                out["teacher_logprobs"] = self._logprobs(
                    self._model("teacher"), mb.teacher_prompts(), mb.response_ids, T
                )
        elif requires & _TEACHER_NEEDS:
            with torch.no_grad(), self._teacher.clock.measure():
                t_logits, targets = self._teacher_logits(mb, T)
            if "teacher_logits" in requires:
                out["teacher_logits"] = t_logits
            if "teacher_logprobs" in requires:
                out["teacher_logprobs"] = token_logprobs(t_logits, targets)
            if topk:
                spec = distillation_of(loss_fn, "topk_logprobs")
                out["topk_logprobs"], out["teacher_topk_logprobs"] = topk_logprobs(logits, t_logits, spec)
        if "ref_logprobs" in requires:
            with torch.no_grad():
                out["ref_logprobs"] = self._logprobs(self._model("reference"), mb.prompt_ids, mb.response_ids, T)
        return out

    # ------------------------------------------------------------------ public API
    def compute(
        self, batch: SequenceBatch, requires: frozenset | set, *, model: str = "policy"
    ) -> dict[str, torch.Tensor]:
        """Quantities in `requires` for the whole batch under no_grad, micro-batched on this rank
        (not DP-sharded): "logprobs"/"entropy" [B, T], "logits" [B, T, V], teacher/ref as in
        REQUIRES. `model` selects the weights used for the policy quantities."""
        batch, T = checked_batch(batch)
        module = self._model(model)
        parts: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for mb_idx in self._micro_batches(list(range(len(batch)))):
                for k, v in self._outputs(batch.select(mb_idx), T, frozenset(requires), module).items():
                    parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}

    def logprobs(self, batch: SequenceBatch, *, model: str = "policy") -> torch.Tensor:
        """[B, T] fp32 log-probs of `batch.response_ids` under `model` ("policy" | "teacher" |
        "reference"); the teacher reads `teacher_prompt_ids` where given. Under DP each rank
        scores its slice and the rows are all-gathered. Padding columns hold 0."""
        batch, T = checked_batch(batch)
        idx = dp_slice(len(batch), self.world, self.rank)
        sub = batch.select(idx)
        module = self._model(model)
        rows = []
        with torch.no_grad():
            for mb_idx in self._micro_batches(list(range(len(sub)))):
                mb = sub.select(mb_idx)
                if model == "teacher" and self._teacher.logit_mix is not None:
                    logits, targets = self._teacher_logits(mb, T)
                    rows.append(token_logprobs(logits, targets))
                else:
                    prompts = mb.teacher_prompts() if model == "teacher" else mb.prompt_ids
                    rows.append(self._logprobs(module, prompts, mb.response_ids, T))
        local = torch.cat(rows) * sub.tensors["response_mask"]
        if self.world == 1:
            return local
        return self._all_gather_rows(local, len(batch))

    def _all_gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        sizes = dp_sizes(n, self.world)
        padded = torch.zeros((sizes[0],) + tuple(local.shape[1:]), dtype=local.dtype)
        padded[: local.shape[0]] = local
        chunks = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(chunks, padded.contiguous())
        return torch.cat([c[:s] for c, s in zip(chunks, sizes, strict=True)])

    @needs_training_state
    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One AdamW step on the global batch. Returns {"loss", "grad_norm", "skipped",
        "samples", <loss metrics summed over the global batch>}; identical on every rank."""
        batch, T = checked_batch(batch)
        requires = frozenset(loss_fn.requires)
        normalizer = loss_fn.global_normalizer(batch.tensors)
        local = dp_slice(len(batch), self.world, self.rank)
        micro = self._micro_batches(local)
        ddp = cast(Any, self._train_module) if self.world > 1 else None  # DistributedDataParallel

        sums = MetricSums()
        self._teacher_seconds()  # only this step's teacher forwards count
        self.optimizer.zero_grad(set_to_none=True)
        for k, mb_idx in enumerate(micro):
            sync = ddp is None or k == len(micro) - 1
            with nullcontext() if sync or ddp is None else ddp.no_sync():
                mb = batch.select(mb_idx)
                outputs = self._outputs(mb, T, requires, self._train_module, loss_fn)
                loss, metrics = loss_fn(outputs, mb.tensors, normalizer)
                # DDP averages gradients over ranks; the loss is already a share of the global
                # sum, so undo the average.
                (loss * self.world).backward()
            sums.add_all(loss, metrics)

        if self._masters is not None:
            # Gradients go to the fp32 masters (clip, norm and AdamW all in fp32).
            for p, m in zip(self.policy.parameters(), self._masters, strict=True):
                m.grad = None if p.grad is None else p.grad.to(torch.float32)
                p.grad = None
        params = [p for p in self._optimized_params() if p.requires_grad]
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            lr = self.lr_schedule.lr(self._sched[0], self._sched[1], self.lr)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self._masters is not None:
                self._masters_to_model()
            self.step += 1
            self._sched = (self._sched[0] + 1, self._sched[1])
        self.optimizer.zero_grad(set_to_none=True)

        result = {
            "grad_norm": float(grad_norm),
            "skipped": 0.0 if finite else 1.0,
            "samples": float(len(batch)),
            "lr": self.optimizer.param_groups[0]["lr"],
            # This rank's seconds in the teacher's forward (the trainer books them as teacher time).
            "time/teacher_forward": self._teacher_seconds(),
        }
        # One collective per reduction kind (sum, max, min), each over a packed tensor.
        result.update(reduce_metrics(sums, sorted(sums.values)))
        return result

    def export_weights(self, *, model: str = "policy") -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF name, tensor) one at a time, in state-dict order. Tensors are detached
        views of the live weights (copy them if you keep them); tied weights are yielded once,
        under the name the HF state dict keeps (e.g. the input embedding)."""
        seen: set[int] = set()
        for name, t in self._model(model).state_dict(keep_vars=False).items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            yield name, t.detach()

    @torch.no_grad()
    def _masters_to_model(self) -> None:
        if self._masters is None:
            raise RuntimeError("no fp32 master weights: the policy's own parameters are fp32")
        for p, m in zip(self.policy.parameters(), self._masters, strict=True):
            p.copy_(m)

    @needs_training_state
    def blend_teacher(self, blend: TeacherBlend) -> None:
        """Apply a teacher update (interfaces/blend.py) to the teacher's fp32 truth: its fp32
        shadow with a bf16/fp16 model, then rounded once into the teacher; else its params. The
        policy enters as its fp32 truth (the master weights with a bf16 model)."""
        if blend.is_identity:
            return
        reference = None if self.reference is None else [p.detach() for p in self.reference.parameters()]
        sources = blend_sources(blend, self.fp32_weights("policy"), reference)
        if sources is None:
            self.teacher_from_base()
            return
        self._teacher.blend(blend, sources)

    def teacher_from_base(self) -> None:
        """Teacher <- the base model (the HF directory this backend was built from)."""
        self.teacher_from_path(self.model_path)

    def teacher_from_path(self, path: str) -> None:
        """Teacher <- the weights of the HF model directory `path` (the student's layout)."""
        self._teacher.load(path)

    def configure_optimizer(self, *, lr: float, weight_decay: float, grad_clip: float, lr_schedule: LRSchedule) -> None:
        """New optimizer settings (a stage's): the peak lr and schedule take effect at the next
        set_lr_schedule, weight decay and clipping at the next step."""
        if lr <= 0:
            raise ConfigError(f"lr must be > 0, got {lr}")
        lr_schedule.check()
        self.lr, self.weight_decay, self.grad_clip, self.lr_schedule = lr, weight_decay, grad_clip, lr_schedule
        self.optimizer.param_groups[0]["weight_decay"] = weight_decay  # group 1 is never decayed

    @needs_training_state
    def reset_optimizer(self) -> None:
        """Fresh AdamW state (moments and step count), e.g. at a stage boundary."""
        self.optimizer = self._make_optimizer()

    def offload_training_state(self) -> int:
        """AdamW's moments and the fp32 masters off the device (offload.py); gradients are
        already freed after every step."""
        state = [t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        return self._offload.offload([*state, *(self._masters or [])], [], keep=list(self.policy.parameters()))

    def reload_training_state(self) -> None:
        self._offload.reload()

    @property
    def training_state_offloaded(self) -> bool:
        return self._offload.active

    def set_lr_schedule(self, total_steps: int | None) -> None:
        """Restart the LR schedule at step 0 of a stage of `total_steps` optimizer steps."""
        self.lr_schedule.check(total_steps)
        self._sched = (0, total_steps)

    # ------------------------------------------------------------------ checkpoints
    @needs_training_state
    def save(self, path: str, *, extra: dict | None = None) -> None:
        """Writes policy/ and teacher/ (HF safetensors dirs), reference/ when present,
        optimizer.pt, rng.pt, extra.json and a COMPLETE marker, atomically (rank 0 writes)."""
        hf_checkpoint.save(self, path, extra=extra)

    @needs_training_state
    def load(self, path: str, *, weights_only: bool = False) -> dict:
        """Restores a checkpoint written by `save`; returns its extra dict. weights_only loads
        policy and teacher weights only (stage transitions keep the fresh optimizer/RNG)."""
        return hf_checkpoint.load(self, path, weights_only=weights_only)
