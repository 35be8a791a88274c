"""How many sequences one vLLM replica's KV cache holds, against what a training step and an eval
call hand it.

vLLM admits sequences while their KV blocks fit; a batch larger than the cache runs in waves,
preempting running sequences and recomputing them later. The dry run counts every sequence at
the full `rollout.max_model_len` (the worst case: prefix caching shares a prompt's blocks across
its samples, and answers end early) and every layer with a full-length cache (sliding-window
layers need less once a sequence passes the window). Each rank of a replica holds the KV heads of
its TP shard: ceil(kv_heads / TP) heads (vLLM replicates KV heads when TP exceeds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sdpo.weights.plan import ModelSpec

GIB = 1024**3
CACHE_BYTES_PER_ELEMENT = 2  # the 16-bit model dtype vLLM caches in on GPU
# Above this the engine would leave the trainer's state no room while it is awake.
MAX_UTILIZATION = 0.9


def kv_bytes_per_token(spec: ModelSpec, rollout_tp: int) -> int:
    """K and V of every layer for one token, on one rank of a TP group."""
    heads = math.ceil(spec.num_kv_heads / rollout_tp)
    return 2 * spec.num_layers * heads * spec.head_dim * CACHE_BYTES_PER_ELEMENT


@dataclass(frozen=True)
class KVCapacity:
    per_token: int  # bytes per token per rank
    cache_bytes: int  # KV cache per rank
    engine_weight_bytes: int  # the engine's weights per rank
    device_bytes: int  # usable device memory per rank
    utilization: float  # rollout.gpu_memory_utilization
    max_len: int  # rollout.max_model_len
    rollout_seqs: int  # sequences per replica per training step
    eval_seqs: int  # sequences per replica per eval call
    samples_per_record: int  # eval samples per record
    awake_other_bytes: int = 0  # what the rollout and eval phases hold besides the engine, per rank
    room_bytes: int = 0  # usable device memory less the context allowance, per rank

    @property
    def tokens(self) -> int:
        return self.cache_bytes // self.per_token

    @property
    def sequences(self) -> int:
        """Full-length sequences the cache holds at once."""
        return self.tokens // self.max_len

    def waves(self, n: int) -> int:
        return math.ceil(n / self.sequences) if self.sequences else 0

    def utilization_for(self, n: int) -> float:
        """The gpu_memory_utilization at which `n` full-length sequences fit."""
        return (self.engine_weight_bytes + n * self.max_len * self.per_token) / self.device_bytes

    def lines(self) -> list[str]:
        return [
            f"KV cache per rank: {self.cache_bytes / GIB:.2f} GiB at {self.per_token / 1024:.0f} KiB per token = "
            f"{self.tokens:,} tokens = {self.sequences:,} sequences of {self.max_len:,} tokens per replica",
            f"KV demand per replica: rollout {self.rollout_seqs} sequences per step ({self._fit(self.rollout_seqs)}), "
            f"eval {self.eval_seqs} per call ({self._fit(self.eval_seqs)})",
        ]

    def _fit(self, n: int) -> str:
        if self.sequences == 0:
            return "no full-length sequence fits"
        return "fits" if n <= self.sequences else f"{self.waves(n)} waves"

    def warnings(self, replicas: int) -> list[str]:
        """One line per batch the cache cannot hold at full length, naming the settings that fit it."""
        out = []
        for what, n in (("rollout", self.rollout_seqs), ("eval", self.eval_seqs)):
            if n <= self.sequences:
                continue
            fixes = []
            util = self.utilization_for(n)
            if util <= MAX_UTILIZATION and self.awake_other_bytes + util * self.device_bytes <= self.room_bytes:
                fixes.append(f"rollout.gpu_memory_utilization={math.ceil(util * 100) / 100:.2f}")
            fixes.append(f"rollout.max_model_len={self.tokens // n}")
            if what == "eval" and self.sequences >= self.samples_per_record:
                fixes.append(f"eval.batch_size={self.sequences // self.samples_per_record * replicas}")
            out.append(
                f"KV cache: the {what} batch ({n} sequences per replica) exceeds the {self.sequences} full-length "
                f"sequences the cache holds at rollout.gpu_memory_utilization={self.utilization}: vLLM preempts "
                f"and recomputes, up to {self.waves(n)} waves when every answer runs to max_model_len; it fits "
                f"with {' or '.join(fixes)}"
            )
        return out
