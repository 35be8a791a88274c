"""`python -m megatron_sdpo ...` (guarded: vLLM and checkpoint writers spawn processes)."""

import sys

from megatron_sdpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
