"""HF <-> megatron-core weight plan (pure) and conversions; see `plan` and `convert`."""

from megatron_sdpo.weights.convert import (
    full_to_hf,
    hf_to_full,
    hf_to_megatron,
    iter_hf,
    megatron_to_hf,
    shard,
    unshard,
)
from megatron_sdpo.weights.plan import Layout, Mapping, ModelSpec, hf_names, owner_stage, plan

__all__ = [
    "Layout",
    "Mapping",
    "ModelSpec",
    "plan",
    "hf_names",
    "owner_stage",
    "hf_to_full",
    "full_to_hf",
    "shard",
    "unshard",
    "hf_to_megatron",
    "megatron_to_hf",
    "iter_hf",
]
