"""One instance per process of a verifier's heavy helper (a sandbox's workers, a math-verify
pool), built on first use. Rollout scoring runs in threads, so the first use is under a lock:
two threads never start two pools."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ProcessWide(Generic[T]):
    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value
