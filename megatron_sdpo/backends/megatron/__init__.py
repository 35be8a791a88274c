"""megatron-core backend: GPTModel policy/teacher over TP x PP x DP, CPU shim for tests.

Importing this package does not import megatron-core; `MegatronBackend` does when built.
"""

from megatron_sdpo.backends.megatron.backend import MegatronBackend
from megatron_sdpo.backends.megatron.model import ModelOptions
from megatron_sdpo.backends.megatron.parallel import ParallelConfig
from megatron_sdpo.backends.megatron.precision import PrecisionConfig

__all__ = ["MegatronBackend", "ModelOptions", "ParallelConfig", "PrecisionConfig"]
