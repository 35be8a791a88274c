"""Training state off the device while the rollout engine is awake (`backend.offload_training_state`).

What only the optimizer step needs (Adam's moments, fp32 main params, megatron's fp32 gradient
buffer) takes a large share of a rank's memory (memory_ledger.py) and nothing reads it while
vLLM generates. As verl and NeMo-RL do around rollout, the trainer moves it out after the
teacher update and brings it back before the next train step.

The tensors stay the same Python objects (optimizer state is keyed by them, gradients are
views of one buffer): each distinct storage is copied to host memory (pinned on CUDA) and
resized to 0 bytes; reload resizes it back and copies the bytes in. Gradient buffers are zeroed
at the start of every step, so they are freed and re-allocated without a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def needs_training_state(method: F) -> F:
    """A backend method that reads or writes the training state (optimizer, main params, grad
    buffers): the state comes back on the device first (`reload_training_state`), wherever the
    trainer left it. The one place a backend says so."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.reload_training_state()
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """One key per distinct storage (views of one buffer share it)."""
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class StateOffload:
    """Frees and restores storages of the training state on `device`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._copied: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.active = False

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() for _, h in self._copied)

    @torch.no_grad()
    def offload(
        self, copied: Iterable[torch.Tensor], dropped: Iterable[torch.Tensor], *, keep: Iterable[torch.Tensor] = ()
    ) -> int:
        """Copy `copied` tensors' storages to host and free them; free `dropped` ones (contents
        not needed); storages shared with `keep` (model weights) stay. Returns bytes freed."""
        if self.active:
            return 0
        kept = {storage_key(t) for t in keep}
        seen: set = set()

        def distinct(tensors: Iterable[torch.Tensor]):
            for t in tensors:
                k = storage_key(t)
                s = t.untyped_storage()
                if k in kept or k in seen or s.nbytes() == 0 or t.device != self.device:
                    continue
                seen.add(k)
                yield s

        pin = self.device.type == "cuda"
        for s in distinct(copied):
            host = torch.empty(s.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes_view(s, self.device), non_blocking=pin)
            self._copied.append((s, host))
        for s in distinct(dropped):
            self._dropped.append((s, s.nbytes()))
        if pin:
            torch.cuda.current_stream(self.device).synchronize()  # copies done before the frees
        freed = 0
        for s, _host in self._copied:
            freed += s.nbytes()
            s.resize_(0)
        for s, n in self._dropped:
            freed += n
            s.resize_(0)
        self.active = True
        return freed

    @torch.no_grad()
    def reload(self) -> None:
        """Everything `offload` freed back on the device: copies restored, dropped ones zeroed."""
        if not self.active:
            return
        pin = self.device.type == "cuda"
        for s, host in self._copied:
            s.resize_(host.numel())
            _bytes_view(s, self.device).copy_(host, non_blocking=pin)
        for s, n in self._dropped:
            s.resize_(n)
            _bytes_view(s, self.device).zero_()
        if pin:
            torch.cuda.current_stream(self.device).synchronize()  # host buffers freed below
        self._copied, self._dropped, self.active = [], [], False
