"""What an object graph holds in tensor memory, counted by storage: the measurement the memory
ledger (memory_ledger.py) is tested against, made without reading the ledger.

`held_bytes(root)` walks containers (dicts, lists, tuples, sets), modules, optimizers and the
attributes of objects of this project, torch and megatron-core, collects every tensor it reaches
and sums the bytes of their distinct storages (views of one buffer count once). `exclude`
removes storages another category already owns (a grad buffer the optimizer also points at).

`SavedTensors` counts what autograd keeps for backward during a forward (activations), by
storage, through `torch.autograd.graph.saved_tensors_hooks`. `TransientPeak` records every tensor
created inside a block (a dispatch mode) and the most bytes of them alive at once: what an
operation adds on top of the state it started from, on any device.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_sdpo.backends.offload import storage_key

# What the ledger is measured on (its tests, tools/loss_memory.py): megatron with BF16 params, an
# EMA teacher and a reference, rows unpacked. MEASURED_LEDGER is that setting in the ledger's
# inputs, so that a measurement and the ledger it checks cannot drift apart.
MEASURED_LEDGER: dict[str, Any] = dict(megatron=True, param_bytes=2, with_teacher=True, with_reference=True)


def measured_backend(model_dir: str, *, lr: float, micro_batch_size: int, **options: Any):
    """The MegatronBackend of that setting; `options`: the measurement's other arguments."""
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig

    return MegatronBackend(
        model_dir,
        lr=lr,
        micro_batch_size=micro_batch_size,
        with_teacher=True,
        with_reference=True,
        options=ModelOptions(precision=PrecisionConfig(params="bfloat16")),
        packing=False,
        **options,
    )


# Attribute walks stop at objects of other libraries (process groups, tokenizers, configs).
_WALKED_MODULES = ("megatron_sdpo", "megatron.core", "torch.optim", "torch.nn", "torch.distributed.optim")
_MAX_DEPTH = 12


def _walked(obj: Any, extra: tuple[str, ...] = ()) -> bool:
    mod = type(obj).__module__ or ""
    return any(mod == m or mod.startswith(m + ".") for m in (*_WALKED_MODULES, *extra))


def tensors_of(root: Any, *, walk: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """Every tensor reachable from `root` (see module docstring; `walk`: more library modules
    whose objects' attributes are followed, e.g. "vllm"), each once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
            grad = obj.grad if obj.is_leaf else None
            for extra in (grad, getattr(obj, "main_grad", None)):
                if isinstance(extra, torch.Tensor):
                    stack.append((extra, depth + 1))
            continue
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
            stack.extend((k, depth + 1) for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in obj)
        elif isinstance(obj, torch.nn.Module):
            # Unbound: megatron's DDP shadows `buffers` with its list of grad buffers.
            stack.extend((t, depth + 1) for t in torch.nn.Module.parameters(obj, recurse=True))
            stack.extend((t, depth + 1) for t in torch.nn.Module.buffers(obj, recurse=True))
            stack.extend((v, depth + 1) for v in vars(obj).values() if not isinstance(v, (dict, torch.nn.Module)))
        elif isinstance(obj, torch.optim.Optimizer) or _walked(obj, walk):
            stack.extend((v, depth + 1) for v in vars(obj).values() if hasattr(obj, "__dict__"))
    return out


def storage_bytes(
    tensors: Iterable[torch.Tensor], *, exclude: set | None = None, device: str | None = None
) -> tuple[int, set]:
    """(bytes of the distinct storages of `tensors` not in `exclude`, their keys); only tensors
    on `device` when given ("cpu", "cuda:0")."""
    keys: dict[tuple[str, int], int] = {}
    for t in tensors:
        if device is not None and str(t.device) != device:
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue  # freed (offloaded) storage
        k = storage_key(t)
        if exclude is None or k not in exclude:
            keys[k] = max(keys.get(k, 0), s.nbytes())
    return sum(keys.values()), set(keys)


def held_bytes(
    root: Any, *, exclude: set | None = None, device: str | None = None, walk: tuple[str, ...] = ()
) -> tuple[int, set]:
    """Bytes of the distinct tensor storages reachable from `root` (and their keys)."""
    return storage_bytes(tensors_of(root, walk=walk), exclude=exclude, device=device)


class SavedTensors:
    """Counts the tensors autograd saves for backward while active, by storage (a saved view of
    a parameter is the parameter: pass its storages as `exclude`)."""

    def __init__(self, exclude: set | None = None):
        self.exclude = exclude or set()
        self.by_key: dict[tuple[str, int], int] = {}
        self.shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        if k not in self.exclude:
            self.by_key[k] = max(self.by_key.get(k, 0), t.untyped_storage().nbytes())
            self.shapes.setdefault(k, tuple(t.shape))
        return t

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def total(self, *, last_dim: int | None = None, not_last_dim: int | None = None) -> int:
        """Bytes saved; only tensors whose last dimension is (or is not) the given size."""
        out = 0
        for k, n in self.by_key.items():
            shape = self.shapes[k]
            last = shape[-1] if shape else 1
            if last_dim is not None and last != last_dim:
                continue
            if not_last_dim is not None and last == not_last_dim:
                continue
            out += n
        return out


class TransientPeak(TorchDispatchMode):
    """The most bytes of tensors created inside the block that were alive at once (by storage,
    released when the last tensor of a storage is collected): what an operation adds on top of
    the state it started with, measured without the allocator (so also on CPU).

    classify: a category per new storage from its first tensor (e.g. vocabulary-wide or not);
    `peaks[category]` is then the most bytes of that category alive at once."""

    def __init__(self, classify: Callable[[torch.Tensor], str] | None = None):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.classify = classify
        self.live_by: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._seen: set[int] = set()

    def _freed(self, key: int, n: int, category: str | None) -> None:
        self.live -= n
        if category is not None:
            self.live_by[category] -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _flat_tensors((args, kwargs))}
        for t in _flat_tensors(out):
            s = t.untyped_storage()
            key = s.data_ptr()
            if key in inputs or key in self._seen or s.nbytes() == 0:
                continue
            self._seen.add(key)
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
            category = self.classify(t) if self.classify is not None else None
            if category is not None:
                self.live_by[category] = self.live_by.get(category, 0) + s.nbytes()
                self.peaks[category] = max(self.peaks.get(category, 0), self.live_by[category])
            weakref.finalize(s, self._freed, key, s.nbytes(), category)
        return out


def _flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat_tensors(o)]
    return []


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)
