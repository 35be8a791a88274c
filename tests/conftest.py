"""Test configuration: skip a marker's tests, with the reason, when its capability is absent."""
import importlib.util
import os

import pytest

# Runs and caches stay inside the test's temporary tree, never in $HOME.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


CAPABILITIES = {
    "megatron": (lambda: _has("megatron.core"), "megatron-core is not installed (pip install -e .[cpu])"),
    "vllm": (lambda: _has("vllm"), "vLLM is not installed (pip install -e .[cpu] or .[gpu])"),
    "triton": (lambda: _has("triton"), "triton is not installed"),
    "gpu": (_cuda, "no CUDA GPU on this machine"),
    "distributed": (lambda: _has("torch.distributed"), "torch.distributed is unavailable"),
}


def pytest_collection_modifyitems(config, items):
    cache: dict[str, bool] = {}
    for item in items:
        for name, (probe, reason) in CAPABILITIES.items():
            if name in item.keywords:
                if name not in cache:
                    cache[name] = bool(probe())
                if not cache[name]:
                    item.add_marker(pytest.mark.skip(reason=reason))
