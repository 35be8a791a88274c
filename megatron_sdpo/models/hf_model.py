"""Loading a transformers causal LM in a process that also holds a colocated vLLM engine.

vLLM serves architectures it has no class of its own for (Olmo-3 in vLLM 0.32) through its
Transformers backend, which decorates the transformers decoder class itself
(`support_torch_compile` on e.g. `Olmo3Model`) for the whole process: the class gains vLLM's
`__init__` and `__call__`. Afterwards a module of that class that the trainer built earlier fails
at its first call (`no attribute 'do_not_compile'`), and one built later fails in its
constructor (no current vLLM config). So every HF model the project loads carries vLLM's own
eager flag from the start: the decorated `__call__` then runs the module's `forward` (the trainer
never wants vLLM's compiled path), and a model is loaded before the engine that could decorate
its class (`load_causal_lm` says so in one line if not).
"""

from __future__ import annotations

from typing import Any

import torch

# The instance flag vLLM's decorated __call__ reads first: True runs `self.forward` directly.
EAGER_FLAG = "do_not_compile"


def keep_eager(model: torch.nn.Module) -> torch.nn.Module:
    """Marks every transformers model inside `model` (the causal LM and its decoder) to run
    eagerly should vLLM decorate its class later; a no-op for classes vLLM never touches."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            setattr(m, EAGER_FLAG, True)
    return model


def load_causal_lm(path: str, dtype: torch.dtype) -> Any:
    """AutoModelForCausalLM.from_pretrained(path, dtype), marked by keep_eager."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except AssertionError as exc:
        if "vLLM config" not in str(exc):
            raise
        # An ordering mistake in the project's code, not the user's: builders load HF models
        # before the rollout engine.
        raise RuntimeError(
            f"{path}: the transformers model was loaded after an in-process vLLM engine decorated its "
            "class (vLLM's Transformers backend); load HF models before building the engine"
        ) from None
    return keep_eager(model)
