"""Which vLLM model class serves the policy in the pinned vLLM (0.32), and what its tensor
parallelism costs at every decode step.

vLLM 0.32 has no class of its own for Olmo, Olmo-2 or Olmo-3: its registry maps them to
`TransformersForCausalLM`, which runs the transformers modeling code with vLLM's layers swapped
in. For Olmo-3 the swap ignores transformers' TP plan (which gathers q, k and v): its fusers put
q/k/v into one `QKVParallelLinear` sharded by heads (so attention and the KV cache are split over
the TP ranks, 1/TP each, as in a native class), o_proj row-parallel, and the full-width QK-norm
into a TP-aware RMSNorm that all-gathers the q shard and the k shard, normalizes, and keeps its
own slice again. Per layer and forward that is 2 all-gathers beside the 2 all-reduces (o_proj,
down_proj) every TP decoder has, as the Olmo-2 class of earlier vLLM releases did (it gathered q
and k for its norm too). Measured on CPU at TP 2 (tests/distributed/test_olmo_loop.py): the KV
cache holds twice the tokens per rank of TP 1, and log-probs agree with the trainer's to 3e-5.

The time is latency, not bandwidth, at decode batch sizes: `TP_COLLECTIVE_S` per collective is
an assumption (a small NCCL collective inside an NVLink node is some 10-20 us), stated where the
plan prints it. The gathered q and k (tokens x (q + k width) per layer, transient) sit in the
activation peak vLLM profiles and takes from its KV budget; the plan prints their size at vLLM's
batched-token cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sdpo.weights.plan import ModelSpec

TRANSFORMERS_BACKEND = frozenset({"olmo", "olmo2", "olmo3"})  # vLLM 0.32's registry
TP_COLLECTIVE_S = 15e-6
ALL_REDUCES_PER_LAYER = 2  # o_proj and down_proj, row-parallel
MAX_BATCHED_TOKENS = 8192  # vLLM's default cap of the tokens in one engine step (chunked prefill)


@dataclass(frozen=True)
class EngineClass:
    vllm_class: str
    collectives_per_layer: int
    gather_bytes_per_layer: int  # the QK-norm's gathered q and k at MAX_BATCHED_TOKENS (0: none)

    def decode_seconds(self, layers: int, decode_steps: int, rollout_tp: int) -> float:
        """TP collectives' time over `decode_steps` engine steps (0 without TP)."""
        return 0.0 if rollout_tp == 1 else decode_steps * layers * self.collectives_per_layer * TP_COLLECTIVE_S

    def line(self, layers: int, decode_steps: int, rollout_tp: int) -> str:
        text = (
            f"vLLM class: {self.vllm_class}; TP {rollout_tp}: {self.collectives_per_layer} collectives a layer "
            f"and forward"
        )
        if self.gather_bytes_per_layer:
            text += (
                f" (2 of them the full-width QK-norm's all-gathers of q and k, transient "
                f"{self.gather_bytes_per_layer / 2**20:.0f} MiB at {MAX_BATCHED_TOKENS} batched tokens)"
            )
        if rollout_tp > 1:
            text += (
                f"; {decode_steps:,} decode steps x {layers} layers at {TP_COLLECTIVE_S * 1e6:.0f} us each = "
                f"{self.decode_seconds(layers, decode_steps, rollout_tp):.0f} s a step, in the planned step"
            )
        return text


def engine_class(spec: ModelSpec, dtype_bytes: int = 2) -> EngineClass:
    """The pinned vLLM's class for `spec` and its TP collectives."""
    full_norm = spec.qk_norm == "full"
    gather = (spec.num_heads + spec.num_kv_heads) * spec.head_dim * MAX_BATCHED_TOKENS * dtype_bytes if full_norm else 0
    name = (
        "TransformersForCausalLM (vLLM's Transformers backend)"
        if spec.arch in TRANSFORMERS_BACKEND
        else f"vLLM's own {spec.arch} class"
    )
    return EngineClass(name, ALL_REDUCES_PER_LAYER + 2 * full_norm, gather)
