"""What the HF and Megatron backends share: the constructor checks, the pad id, the named-model
lookup, the empty-batch check, the data-parallel split of a global batch and the reduction of
loss metrics over micro-batches and ranks.

Both backends take the same contiguous data-parallel slices and reduce metrics by the same
convention (`metric_reduce`), which is what lets a test hold their loss, metrics and updated
weights equal.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_sdpo.algorithms.losses import metric_reduce
from megatron_sdpo.errors import ConfigError, DataError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.interfaces.blend import TeacherBlend

MODEL_NAMES = ("policy", "teacher", "reference")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# What a rank with no share of a metric contributes to its reduction (the op's identity).
_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}


def check_backend_args(model_path: str, *, lr: float, micro_batch_size: int, logit_temperature: float = 1.0) -> None:
    """The constructor checks every backend shares (ConfigError naming the bad value)."""
    if isinstance(logit_temperature, bool) or not logit_temperature > 0:
        raise ConfigError(f"logit_temperature must be > 0, got {logit_temperature!r}")
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if lr <= 0:
        raise ConfigError(f"lr must be > 0, got {lr}")
    if not Path(model_path, "config.json").is_file():
        raise ConfigError(f"model_path {model_path!r} is not a HF model directory (no config.json)")


def resolve_pad_id(pad_token_id: int | None, hf_config) -> int:
    """The pad id rows are built with: the caller's (the tokenizer's), else the model config's
    pad id, else its (first) eos id, else 0. Pad positions are masked out everywhere, so any
    valid id works when the config names none."""
    if pad_token_id is None:
        pad_token_id = hf_config.pad_token_id if hf_config.pad_token_id is not None else hf_config.eos_token_id
    if isinstance(pad_token_id, (list, tuple)):
        pad_token_id = pad_token_id[0]
    return int(pad_token_id) if pad_token_id is not None else 0


def blend_sources(blend: TeacherBlend, policy: list[torch.Tensor], reference: list[torch.Tensor] | None) -> dict | None:
    """The weight lists `blend_` reads for `blend`: the policy's fp32 truth and the resident
    reference's params (the base model). None when the blend replaces the teacher with the base
    and no reference is resident: the caller then loads the base from its directory. A blend
    that mixes the base into something else needs the reference resident."""
    if blend.reference and reference is None:
        if blend.reference < 1.0:
            raise ConfigError(
                f"the teacher update {blend} mixes in the base model, which needs the reference resident "
                "(diagnostics.enabled=true or algorithm.grpo.kl_coef > 0)"
            )
        return None
    sources = {"policy": policy}
    if reference is not None:
        sources["reference"] = reference
    return sources


def named_model(name: str, models: dict):
    """`models[name]` for name in MODEL_NAMES; ConfigError for another name or for a model the
    backend was built without (its entry is None)."""
    if name not in MODEL_NAMES:
        raise ConfigError(f"model must be 'policy', 'teacher' or 'reference', got {name!r}")
    m = models.get(name)
    if m is None:
        raise ConfigError(f"this backend was built without a {name} model (with_{name}=False)")
    return m


def checked_batch(batch: SequenceBatch) -> tuple[SequenceBatch, int]:
    """(`batch.checked()`, its response length T); DataError when every response is empty."""
    T = batch.max_response_len
    if T == 0:
        raise DataError("every response in the batch is empty")
    return batch.checked(), T


def dp_sizes(n: int, world: int) -> list[int]:
    """Samples of each of `world` data-parallel ranks in a global batch of n: near-equal, the
    first n % world ranks one more (np.array_split order)."""
    if n < world:
        raise DataError(f"global batch of {n} samples is smaller than the data-parallel size {world}")
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def dp_slice(n: int, world: int, rank: int) -> list[int]:
    """The contiguous sample indices of data-parallel `rank` in a global batch of n."""
    sizes = dp_sizes(n, world)
    start = sum(sizes[:rank])
    return list(range(start, start + sizes[rank]))


class MetricSums:
    """The loss and metric shares of the micro-batches one rank ran, each combined the way it
    reduces over ranks (`metric_reduce`: sums, or max / min for `_max` / `_min` names), as
    detached fp32 scalars."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().float().reshape(())
        old = self.values.get(name)
        if old is None:
            self.values[name] = v
            return
        op = metric_reduce(name)
        self.values[name] = torch.maximum(old, v) if op == "max" else torch.minimum(old, v) if op == "min" else old + v

    def add_all(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's (loss, metrics) as a LossFn returns them."""
        self.add("loss", loss)
        for name, v in metrics.items():
            self.add(name, v)


def reduce_metrics(
    sums: MetricSums | None, names: list[str], device: torch.device | str | None = None, group=None
) -> dict[str, float]:
    """{name: value} of `names` over the ranks of `group` (every rank gets the result): one
    collective per reduction kind, over a packed fp32 tensor on `device` (the collective's
    device; None: where the sums are). A rank that ran no loss passes `sums=None` (and a
    device) and contributes each op's identity. Without a multi-rank process group the local
    values are returned."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    out: dict[str, float] = {}
    for op in ("sum", "max", "min"):
        group_names = [n for n in names if metric_reduce(n) == op]
        if not group_names:
            continue
        if sums is None:
            vals = torch.full((len(group_names),), _IDENTITY[op], dtype=torch.float32, device=device)
        else:
            vals = torch.stack([sums.values[n] for n in group_names])
            vals = vals if device is None else vals.to(device)
        vals = vals.contiguous()
        if world > 1:
            dist.all_reduce(vals, op=_REDUCE_OPS[op], group=group)
        out.update(zip(group_names, vals.tolist(), strict=True))
    return out
