"""What each `backend.name` can do, as one typed table (algorithm_spec.py is its twin for
algorithms).

Code asks the spec -- where are the student's top-k ids picked, can packed rows share a prompt,
are full logits vocabulary-sharded, is there FP8, does the backend run model-parallel -- instead
of comparing names (does it initialise the teacher from a checkpoint, run the trust-region
teacher); `builders.py` is the one place a name picks a class. The tri-state keys
`backend.packing` and `backend.share_prompts` (null: the backend's default) are resolved here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sdpo.config.schema import BackendConfig
from megatron_sdpo.errors import ConfigError


@dataclass(frozen=True)
class BackendSpec:
    name: str
    # Where the student's top-k ids are picked for top-k distillation: "logits" (the backend
    # hands the loss [B, T, V] logits and the loss picks them) or "shards" (its logits stay
    # vocabulary-sharded, so it computes the top-k log-probabilities itself).
    topk_source: Literal["logits", "shards"]
    # `backend.megatron.*` sets its layout (TP / PP, parameter dtype, distributed optimizer), and
    # a launch gives it one process per GPU.
    model_parallel: bool
    # Under tensor parallelism its full logits are vocabulary-sharded: full-vocabulary
    # distillation then goes through the fused vocab-parallel KL.
    vocab_sharded_logits: bool
    # Its packed rows can share a group's prompt (an explicit tree mask; THD segment lists
    # cannot state one).
    shares_prompts: bool
    # FP8 through Transformer Engine (`backend.megatron.fp8`).
    fp8: bool
    # `backend.packing: null` packs for every model (True), or wherever the model's layers take
    # packed rows (False: the backend decides from the model; Olmo keeps the padded layout).
    packs_every_model: bool
    # The reference's teacher options: initialising the teacher from a checkpoint
    # (`teacher.init_path`) and the trust-region teacher (a second policy forward on the
    # teacher's context, mixed in logit space).
    teacher_init: bool
    trust_region_teacher: bool

    def packing(self, b: BackendConfig) -> bool | None:
        """`backend.packing` resolved: on or off, or None where the backend decides from the
        model's layers."""
        if b.packing is not None:
            return b.packing
        return True if self.packs_every_model else None

    def share_prompts(self, b: BackendConfig) -> bool:
        """`backend.share_prompts` resolved (null: wherever packed rows can share a prompt)."""
        return self.shares_prompts and self.packing(b) is not False and b.share_prompts is not False


BACKENDS: dict[str, BackendSpec] = {
    s.name: s
    for s in (
        BackendSpec(
            "hf",
            topk_source="logits",
            model_parallel=False,
            vocab_sharded_logits=False,
            shares_prompts=True,
            fp8=False,
            packs_every_model=True,
            teacher_init=True,
            trust_region_teacher=True,
        ),
        BackendSpec(
            "megatron",
            topk_source="shards",
            model_parallel=True,
            vocab_sharded_logits=True,
            shares_prompts=False,
            fp8=True,
            packs_every_model=False,
            teacher_init=False,
            trust_region_teacher=False,
        ),
    )
}


def backend_spec(name: str) -> BackendSpec:
    """The spec of `backend.name`; ConfigError naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"backend.name: unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None
