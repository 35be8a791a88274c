"""Checkpoints of the HF backend: HF safetensors directories of its models plus the optimizer,
fp32 state and RNG, written atomically (backends/checkpoint.py) and read back strictly. `be` is
the HFBackend whose state is saved or restored."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_sdpo.backends.checkpoint import atomic_checkpoint_dir, check_complete, load_hf_weights, torch_load
from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.interfaces.blend import copy_

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def save(be, path: str, *, extra: dict | None = None) -> None:
    """Writes policy/ and teacher/ (HF safetensors dirs), reference/ when present,
    optimizer.pt, rng.pt, extra.json and a COMPLETE marker, atomically (rank 0 writes)."""
    extra = dict(extra or {})
    json.dumps(extra)  # fail before writing anything if extra is not JSON-serializable
    if be.rank == 0:
        with atomic_checkpoint_dir(path) as tmp:
            for name in ("policy", "teacher", "reference"):
                m = getattr(be, name)
                if m is not None:
                    m.save_pretrained(str(tmp / name), safe_serialization=True)
                    _copy_tokenizer(be, tmp / name)
            torch.save(
                {"optimizer": be.optimizer.state_dict(), "step": be.step, "lr_schedule": list(be._sched)},
                tmp / "optimizer.pt",
            )
            if be._masters is not None:
                torch.save(
                    {
                        "masters": [m.detach() for m in be._masters],
                        "teacher": None if be.teacher_state is None else be.teacher_state.shadow,
                    },
                    tmp / "fp32_state.pt",
                )
            torch.save(
                {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                tmp / "rng.pt",
            )
            (tmp / "extra.json").write_text(json.dumps(extra))
    if be.world > 1:
        dist.barrier()


@torch.no_grad()
def _load_fp32_state(be, root: Path) -> None:
    """Restore the fp32 masters / teacher shadow saved next to the bf16 weights; without
    that file (a checkpoint written in fp32, or an HF directory) they restart from the
    weights just loaded."""
    if be._masters is None:
        return
    f = root / "fp32_state.pt"
    state = torch_load(f) if f.is_file() else {}
    masters = state.get("masters") or [p.detach() for p in be.policy.parameters()]
    copy_(be._masters, masters)
    if be.teacher_state is not None:
        be.teacher_state.resync(state.get("teacher"))


def _copy_tokenizer(be, dest: Path) -> None:
    for f in _TOKENIZER_FILES:
        src = Path(be.model_path, f)
        if src.is_file():
            shutil.copyfile(src, dest / f)


def load(be, path: str, *, weights_only: bool = False) -> dict:
    """Restores a checkpoint written by `save`; returns its extra dict. weights_only loads
    policy and teacher weights only (stage transitions keep the fresh optimizer/RNG)."""
    root = check_complete(path)
    load_hf_weights(be.policy, root / "policy")
    if be.teacher is not None:
        load_hf_weights(be.teacher, root / "teacher")
    _load_fp32_state(be, root)
    try:
        extra = json.loads((root / "extra.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable extra.json ({exc})") from None
    if weights_only:
        return extra
    if be.reference is not None and (root / "reference").is_dir():
        load_hf_weights(be.reference, root / "reference")
    opt = torch_load(root / "optimizer.pt")
    be.optimizer = be._make_optimizer()
    be.optimizer.load_state_dict(opt["optimizer"])
    # torch.load's storages cannot be resized, and the offload of the training state frees the
    # moments by resizing their storages in place: own copies.
    for state in be.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()
    be.step = int(opt["step"])
    be._sched = tuple(opt.get("lr_schedule", (0, None)))
    rng = torch_load(root / "rng.pt")
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return extra
