"""megatron_sdpo: continual post-training of LLMs with GRPO and self-distillation (SDPO).

Importing the package is cheap and imports no GPU-only dependency; heavy modules (vLLM,
megatron-core, Triton, Transformer Engine) are imported where they are used.
"""

import time as _time

__version__ = "0.1.0"

# A run's wall time starts with the package's import: the imports on its start-up path are
# part of what a run costs (stopwatch.RunClock, the run's timings.json).
IMPORTED_AT = _time.perf_counter()
