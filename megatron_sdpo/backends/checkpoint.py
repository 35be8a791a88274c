"""Atomic checkpoint directories and strict loading helpers shared by the backends.

A checkpoint is written to `<path>.tmp-<pid>`, every file is fsynced, a `COMPLETE` marker is
written last, and the directory is renamed into place; a reader that does not find `COMPLETE`
treats the directory as partial. Every failure a user can cause (missing, partial, truncated or
foreign files) becomes a one-line CheckpointError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from megatron_sdpo.errors import CheckpointError

COMPLETE = "COMPLETE"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(d: Path) -> None:
    """fsync a directory, so a rename or new entry in it survives a crash."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_checkpoint_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a fresh temporary directory next to `path`; on success fsyncs it, writes
    COMPLETE, and renames it to `path` (replacing an older checkpoint there). On an exception
    the temporary directory is removed and `path` is left untouched."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        marker = tmp / COMPLETE
        marker.write_text("ok\n")
        fd = os.open(marker, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(tmp)
        old = None
        if final.exists():
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException as exc:
        full = _disk_full(tmp, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise CheckpointError(
                f"checkpoint {final} not written: {full}; free space there and continue with --resume "
                "(the last complete checkpoint is kept)"
            ) from exc
        raise


# Less than this left beside a failed write: the disk is why (torch.save reports a full disk as a
# RuntimeError, "unexpected pos", with no errno).
_FULL_BYTES = 64 * 2**20


def _disk_full(tmp: Path, exc: BaseException) -> str:
    """Why a checkpoint write failed when the disk is the reason ('' otherwise)."""
    nospace = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not (nospace or isinstance(exc, (OSError, RuntimeError))):
        return ""
    try:
        free = shutil.disk_usage(tmp).free
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    except OSError:
        return "no space left on the device" if nospace else ""
    if not nospace and free >= _FULL_BYTES:
        return ""
    return f"the disk is full ({free / 2**30:.2f} GiB free after {written / 2**30:.2f} GiB of it were written)"


def check_complete(path: str | os.PathLike) -> Path:
    """Returns `path` as a Path if it is a complete checkpoint, else raises CheckpointError."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (root / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {path} is partial (no {COMPLETE} marker): it was not fully written")
    return root


def torch_load(f: Path) -> dict:
    """torch.load of a file we wrote, with a one-line error when it is missing or corrupt."""
    if not f.is_file():
        raise CheckpointError(f"checkpoint file {f} is missing")
    try:
        # Our own files: optimizer state and numpy/python RNG tuples need full unpickling.
        return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as exc:  # any unpickling failure means a corrupt file
        raise CheckpointError(f"checkpoint file {f} is corrupt ({type(exc).__name__}: {exc})") from None


def load_hf_weights(model: nn.Module, directory: Path) -> None:
    """Loads every *.safetensors file of a save_pretrained dir into `model` in place.

    Raises CheckpointError if a file is missing or truncated, a tensor has the wrong shape, an
    unknown name appears, or a parameter is missing (tied weights the HF state dict dedups
    excepted)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise CheckpointError(f"checkpoint weights missing: no *.safetensors in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises several types on bad bytes
            raise CheckpointError(f"checkpoint file {f} is corrupt ({type(exc).__name__}: {exc})") from None
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise CheckpointError(f"{directory}: tensors not in the model: {unknown[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise CheckpointError(
                f"{directory}: {name} has shape {tuple(t.shape)}, the model expects {tuple(own[name].shape)}"
            )
    loaded_ptrs = {own[n].untyped_storage().data_ptr() for n in state}
    missing = [n for n, t in own.items() if n not in state and t.untyped_storage().data_ptr() not in loaded_ptrs]
    if missing:
        raise CheckpointError(f"{directory}: weights missing from the checkpoint: {missing[:5]}")
    with torch.no_grad():
        for name, t in state.items():
            own[name].copy_(t)
