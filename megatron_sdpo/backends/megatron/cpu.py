"""Run megatron-core on a CPU-only machine (tests and `backend=megatron` CPU runs).

megatron-core assumes CUDA in a handful of places: `torch.cuda.current_device()` used as a
device, hard-coded `device="cuda"` in schedules / optimizer / grad clipping / checkpointing,
CUDA RNG state in the tensor-parallel RNG tracker, streams and events, and optimizer asserts on
`p.type() == "torch.cuda.FloatTensor"`. `install()` maps each of these onto the CPU:

* a few `torch.cuda` functions become CPU equivalents or no-ops;
* a `TorchFunctionMode` rewrites CUDA device arguments (``"cuda"``, ``"cuda:0"``, a CUDA
  `torch.device`, a bare index) to CPU and makes the no-argument `Tensor.type()` string read
  ``torch.cuda.*`` (the optimizer's dtype dispatch keys on it);
* megatron's RNG-tracker helpers read and write the CPU default generator.

The mode is thread-local and changes `Tensor.type()` for the whole thread, so it is meant for
CPU processes only: `install()` refuses to run where CUDA is available, and nothing imports
this module on a GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_mode: _CpuDeviceMode | None = None


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # A bare int in a device slot is a CUDA ordinal for torch factories and `.to()`.
    return isinstance(dev, int) and not isinstance(dev, bool)


def _cpu_if_cuda(dev):
    return torch.device("cpu") if _is_cuda_device(dev) else dev


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and dresses up `Tensor.type()` as CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            # `.to("cuda")`, `.to(0)`, `.to(torch.device("cuda"))`: the positional device slot.
            args = (args[0], torch.device("cpu")) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for `torch.cuda.Stream` / `Event`: everything runs in program order on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_torch_cuda() -> None:
    # Typed as Any: replacing the module's functions with CPU stand-ins is the point here.
    cuda: Any = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    # The generator itself, not torch.manual_seed: that one calls cuda.manual_seed_all.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()


def _patch_megatron_rng() -> None:
    """The tensor-parallel RNG tracker forks and restores 'CUDA' state: use the CPU generator."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core absent: the shim still serves plain torch code
        return
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _under_mode(fn):
    """fn run with the CPU device mode active (autograd runs backward without the caller's
    torch-function modes, so device arguments there would still say CUDA)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _mode_active():
            return fn(*args, **kwargs)
        with _CpuDeviceMode():
            return fn(*args, **kwargs)

    return wrapped


def _patch_megatron_backward() -> None:
    """The backward of megatron's tensor-parallel autograd Functions allocates its all-gather /
    reduce-scatter buffers on `torch.cuda.current_device()` (sequence parallelism, TP linears):
    run those backwards under the device mode."""
    try:
        from megatron.core.tensor_parallel import layers, mappings
    except ImportError:
        return
    for mod in (mappings, layers):
        for obj in list(vars(mod).values()):
            if not (
                isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and obj.__module__ == mod.__name__
            ):
                continue
            backward = vars(obj).get("backward")
            if isinstance(backward, staticmethod) and not getattr(backward.__func__, "_cpu_shim", False):
                fn = _under_mode(backward.__func__)
                cast(Any, fn)._cpu_shim = True
                cast(Any, obj).backward = staticmethod(fn)


def install() -> None:
    """Install the shim in this process/thread; idempotent.

    Call before building models and before seeding. Raises RuntimeError on a CUDA machine:
    there the real code paths must run.
    """
    global _mode
    if torch.cuda.is_available():
        raise RuntimeError("the megatron CPU shim must not be installed where CUDA is available")
    with _lock:
        if _mode is None:
            _patch_torch_cuda()
            _patch_megatron_rng()
            _patch_megatron_backward()
            _mode = _CpuDeviceMode()
            _mode.__enter__()
        elif not _mode_active():
            # A new thread: the mode stack is thread-local, so push it here too.
            _CpuDeviceMode().__enter__()


def _mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, _CpuDeviceMode) for m in _get_current_function_mode_stack())


def installed() -> bool:
    """True when the shim is active in the calling thread."""
    return _mode is not None and _mode_active()
