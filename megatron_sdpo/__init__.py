"""megatron_sdpo: continual post-training of LLMs with GRPO and self-distillation (SDPO).

Importing the package is cheap and imports no GPU-only dependency; heavy modules (vLLM,
megatron-core, Triton, Transformer Engine) are imported where they are used.
"""

__version__ = "0.1.0"
