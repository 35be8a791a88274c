"""Stale vLLM CPU all-reduce segments: only this user's, only the ones no live process maps."""

import mmap
import os
import subprocess
import sys
import time

import pytest

from megatron_sdpo.rollout.shm_segments import mapped_files, remove_stale_segments

# vLLM's names under external_launcher (the ident is the empty part before the first dash).
OURS_MAPPED_HERE = "-tp:0-[0-1]-cpushm_0"
STALE = "-tp:0-[0-1]-cpushm_1"
MAPPED_BY_CHILD = "-tp:0-[2-3]-cpushm_2"
LEFT_BY_DEAD_CHILD = "-tp:0-[2-3]-cpushm_3"
NOT_VLLM = "psm_0a1b2c3d"

_MAP_AND_WAIT = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _segment(d, name):
    p = d / name
    p.write_bytes(b"\0" * 4096)
    return p


def _child_mapping(path, seconds):
    child = subprocess.Popen(
        [sys.executable, "-c", _MAP_AND_WAIT, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "mapped"
    return child


def test_removes_only_segments_no_live_process_maps(tmp_path):
    for name in (OURS_MAPPED_HERE, STALE, MAPPED_BY_CHILD, LEFT_BY_DEAD_CHILD, NOT_VLLM):
        _segment(tmp_path, name)
    with open(tmp_path / OURS_MAPPED_HERE, "r+b") as f:
        here = mmap.mmap(f.fileno(), 4096)
    live = _child_mapping(tmp_path / MAPPED_BY_CHILD, 60)
    dead = _child_mapping(tmp_path / LEFT_BY_DEAD_CHILD, 0)
    dead.wait(timeout=30)
    try:
        assert {OURS_MAPPED_HERE, MAPPED_BY_CHILD} <= mapped_files(tmp_path)
        assert LEFT_BY_DEAD_CHILD not in mapped_files(tmp_path)
        assert remove_stale_segments(tmp_path) == sorted([STALE, LEFT_BY_DEAD_CHILD])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([OURS_MAPPED_HERE, MAPPED_BY_CHILD, NOT_VLLM])
        assert remove_stale_segments(tmp_path) == []  # nothing left to remove; repeatable
    finally:
        live.kill()
        live.wait()
        here.close()
    # Once its process ended, the child's segment is stale too.
    deadline = time.monotonic() + 10
    while MAPPED_BY_CHILD in mapped_files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remove_stale_segments(tmp_path) == sorted([OURS_MAPPED_HERE, MAPPED_BY_CHILD])


def test_another_users_segment_is_left(tmp_path):
    if os.getuid() != 0:
        pytest.skip("only root can make a file that another user owns")
    p = _segment(tmp_path, STALE)
    os.chown(p, 65534, 65534)
    assert remove_stale_segments(tmp_path) == []
    assert p.exists()


def test_a_missing_directory_removes_nothing(tmp_path):
    assert remove_stale_segments(tmp_path / "absent") == []
