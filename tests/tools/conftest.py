"""The bench scripts import their harness as a sibling module (`python tools/bench_x.py` puts
tools/ on sys.path); tests that import a script or the harness need the same."""

import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
