"""vLLM's CPU shared-memory all-reduce segments that a killed launch left in /dev/shm.

vLLM (CPU, TP > 1) names each rank's segment `<ident>-<group>-[<ranks>]-cpushm_<rank>` and
creates it exclusively. Under `external_launcher` its CPU worker sets the ident from the
`env://` init method, so every launch on a node uses the same names (the `VLLM_DIST_IDENT` a
caller sets is overwritten). A clean exit unlinks them; a killed one (a node's processes killed,
a time limit's SIGKILL, a test's timeout) leaves them, and every later TP > 1 engine on that node
failed with `create shm in SHMManager failed. errno: 17` (EEXIST).

A segment is stale when no live process maps it: this module removes those, and only those, of
this user's segments. A segment a live engine maps is left alone (a second engine with the same
names on the node fails in vLLM as before: vLLM cannot run two such launches on one node)."""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r".*-cpushm_\d+")


def mapped_files(directory: Path, proc: Path = Path("/proc")) -> set[str]:
    """Names of the files in `directory` that the processes this user can inspect map."""
    prefix = f"{directory}/"
    names: set[str] = set()
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            maps = (pid / "maps").read_text()
        except OSError:  # ended meanwhile, or another user's process
            continue
        for line in maps.splitlines():
            at = line.find(prefix)
            if at >= 0:
                names.add(line[at + len(prefix) :].removesuffix(" (deleted)"))
    return names


def remove_stale_segments(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[str]:
    """Unlinks this user's vLLM CPU segments in `shm_dir` that no live process maps; returns
    their names."""
    if not shm_dir.is_dir():
        return []
    uid = os.getuid()
    candidates = []
    for f in shm_dir.iterdir():
        try:
            if _SEGMENT.fullmatch(f.name) and f.is_file() and f.stat().st_uid == uid:
                candidates.append(f)
        except OSError:
            continue
    if not candidates:
        return []
    in_use = mapped_files(shm_dir, proc)
    removed = []
    for f in candidates:
        if f.name in in_use:
            continue
        try:
            f.unlink()
            removed.append(f.name)
        except FileNotFoundError:  # another process of this node removed it first
            continue
    return sorted(removed)
