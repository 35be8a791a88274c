"""Atomic checkpoint directories: a write that fails leaves nothing behind, and a full disk is
named as such (one line) instead of torch.save's 'unexpected pos' traceback."""

import errno
import shutil
from collections import namedtuple

import pytest

from megatron_sdpo.backends import checkpoint as C
from megatron_sdpo.errors import CheckpointError

Usage = namedtuple("Usage", "total used free")


def _write_then_fail(path, exc):
    with C.atomic_checkpoint_dir(path) as tmp:
        (tmp / "policy.bin").write_bytes(b"x" * 3000)
        raise exc


def test_a_complete_write_is_renamed_into_place(tmp_path):
    with C.atomic_checkpoint_dir(tmp_path / "ck") as tmp:
        (tmp / "a").write_text("1")
    assert C.check_complete(tmp_path / "ck") == tmp_path / "ck"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_a_full_disk_is_one_checkpoint_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 10 * 2**30, 2**20))
    with pytest.raises(CheckpointError) as info:
        _write_then_fail(tmp_path / "stage_2", RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos"))
    msg = str(info.value)
    assert "disk is full (0.00 GiB free after 0.00 GiB of it were written)" in msg and "--resume" in msg
    assert "\n" not in msg and list(tmp_path.iterdir()) == []


def test_no_space_errno_is_named_whatever_the_free_space_now(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 0, 5 * 2**30))
    with pytest.raises(CheckpointError, match="disk is full"):
        _write_then_fail(tmp_path / "ck", OSError(errno.ENOSPC, "No space left on device"))


def test_other_failures_pass_through_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 0, 5 * 2**30))
    with pytest.raises(RuntimeError, match="a bug"):
        _write_then_fail(tmp_path / "ck", RuntimeError("a bug"))
    with pytest.raises(KeyboardInterrupt):  # not a disk error, even on a full disk
        monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1, 1, 0))
        _write_then_fail(tmp_path / "ck", KeyboardInterrupt())
    assert list(tmp_path.iterdir()) == []
