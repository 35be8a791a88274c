#!/usr/bin/env python
"""Parameter (and optionally response) drift between two HF checkpoints.

    python tools/drift_report.py A B --out DIR [--overlap-with C D] [--responses]

Writes DIR/drift.json and PNG plots; a missing or corrupt checkpoint prints one
`error: ...` line on stderr and exits 1. Same as `megatron-sdpo drift`.
"""
import sys

from megatron_sdpo.diagnostics.drift import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
