"""Checkpoints of the megatron backend with megatron-core dist_checkpointing.

Layout of a checkpoint directory:
    (dist_checkpointing files)  policy, teacher (keys prefixed "teacher."), optimizer (the
                                distributed optimizer in its "fully_reshardable" format, so a
                                run can resume under another DP size; gathered to DP
                                rank 0 in host memory), step, LR schedule and extra (common)
    rng/rank<r>.pt              per-rank torch and megatron RNG-tracker states
    policy/                     the policy as an HF model directory (evaluation, diagnostics)
    layout.json                 tp, pp, dp of the writer
    COMPLETE                    written last, after every rank finished

Atomic: every rank writes into `<path>.partial`; rank 0 writes COMPLETE and renames it into
place only after a barrier. A directory without COMPLETE is never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from megatron_sdpo.backends.checkpoint import fsync_dir
from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.stop_request import SIGNALS as STOP_SIGNALS
from megatron_sdpo.stop_request import serve_parent
from megatron_sdpo.weights.hf_writer import HFDirWriter, write_hf_dir

COMPLETE = "COMPLETE"
# "fully_reshardable" (a run resumes under another TP / DP layout), gathered through host memory
# to DP rank 0 over gloo: megatron's default all-gathers every bucket's main params and Adam
# moments to every DP rank on the device (the memory plan's "checkpoint" phase would hold that
# much more, and every rank the whole optimizer in host memory at each save).
_OPT_META = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}
_TEACHER = "teacher."
_SHADOW = "teacher_fp32"


def _start_writer_queue() -> None:
    """Start dist_checkpointing's writer results queue (a Manager process that lives as long as
    the rank) as a helper that ignores the stop signals and dies with the rank (serve_parent).

    A stop signal reaches every process of a rank's job (Slurm signals them all, torchrun the
    rank's group), which would kill that process just before the save the signal asks for
    (BrokenPipeError); and a rank killed outright left it running, reparented to init. The stop
    signals are ignored from before the spawn (ignored dispositions survive the exec), so a
    signal during its sub-second start is not lost on it; the rank's own handler is back after."""
    from multiprocessing.managers import SyncManager

    import torch.multiprocessing as mp
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if (
        getattr(filesystem_async, "_results_queue", None) is not None
        or threading.current_thread() is not threading.main_thread()
    ):
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=serve_parent, initargs=(os.getpid(),))
        # The proxy holds the manager: the process lives as long as the queue megatron keeps.
        filesystem_async._results_queue = manager.Queue()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _shadow_file(backend) -> str:
    return f"tp{backend.tp_rank}_pp{backend.pp_rank}"


def _load_teacher_shadow(backend, root: Path) -> None:
    """Restore the teacher's fp32 EMA shadow (bf16 params) from the pieces every DP rank saved.
    A checkpoint without one (written with fp32 params) gives its teacher weights, which were
    the fp32 truth."""
    shadow = backend.teacher_fp32
    if shadow is None:
        return
    files = sorted((root / _SHADOW).glob(f"{_shadow_file(backend)}_dp*.pt"))
    if files:
        layout = json.loads((root / "layout.json").read_text())
        if (layout["tp"], layout["pp"]) != (backend.layout.tp, backend.layout.pp):
            raise CheckpointError(
                f"{root}: the fp32 teacher shadow was saved at tp={layout['tp']} pp={layout['pp']}; "
                f"resume with the same tensor/pipeline parallel sizes"
            )
        states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
        shadow.load_states(states, str(root / _SHADOW))
    else:
        shadow.resync(list(backend.teacher.parameters()))


def _inner(model):
    return getattr(model, "module", model)


def _sharded(backend, *, optimizer: bool, is_loading: bool) -> dict:
    state: dict = {"policy": _inner(backend.policy).sharded_state_dict()}
    if backend.teacher is not None:
        state["teacher"] = backend.teacher.sharded_state_dict(prefix=_TEACHER)
    if optimizer:
        state["optimizer"] = backend.optimizer.sharded_state_dict(
            state["policy"], is_loading=is_loading, metadata=_OPT_META
        )
    return state


def save(backend, path: str, *, extra: dict | None = None, hf_policy: bool = True) -> None:
    """Collective save of the backend's policy, teacher, optimizer, LR schedule, RNG, step and `extra`.

    hf_policy: also write `policy/` as an HF model directory (what evaluation and drift
    diagnostics read); the weights are streamed to rank 0 one tensor at a time."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    extra = dict(extra or {})
    json.dumps(extra)  # fail on every rank before anything is written
    final = Path(path)
    tmp = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)  # empty: dist_checkpointing warns about a non-empty target
    dist.barrier()
    state = _sharded(backend, optimizer=True, is_loading=False)
    state["step"] = backend.step
    state["lr_schedule"] = {"total": backend._sched_total, "state": backend.scheduler.state_dict()}
    state["extra"] = extra
    _start_writer_queue()
    dist_checkpointing.save(state, str(tmp))
    if rank == 0:
        (tmp / "rng").mkdir()
        (tmp / _SHADOW).mkdir()
    dist.barrier()
    shadow = backend.teacher_fp32
    if shadow is not None and (shadow.sharded or backend.dp_rank == 0):
        # Each DP rank's pieces of the fp32 EMA shadow (one rank's full copy without the
        # distributed optimizer), with their element ranges: any DP size can load them.
        torch.save(shadow.state(), tmp / _SHADOW / f"{_shadow_file(backend)}_dp{backend.dp_rank}.pt")
    torch.save(
        {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()},
        tmp / "rng" / f"rank{rank}.pt",
    )
    if hf_policy:
        # Every rank takes part in the export's gathers; rank 0 moves each tensor to host as it
        # comes and writes it in the model dtype: no state dict on the device, no model built.
        writer = (
            HFDirWriter(tmp / "policy", backend.model_path, tied=backend.spec.tie_word_embeddings)
            if rank == 0
            else None
        )
        for name, t in backend.export_weights(model="policy"):
            if writer is not None:
                writer.add(name, t)
        if writer is not None:
            writer.close()
    dist.barrier()
    if rank == 0:
        lay = backend.layout
        (tmp / "layout.json").write_text(json.dumps({"tp": lay.tp, "pp": lay.pp, "dp": lay.dp}))
        for dirpath, _, files in os.walk(tmp):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        (tmp / COMPLETE).write_text("ok\n")
        fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def _strip(sd: dict, prefix: str) -> dict:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in sd.items()}


def _ensure_optimizer_state(optimizer) -> list:
    """Give a fresh optimizer its (zero) Adam state and a step, so that its sharded state dict
    has the structure of a saved one (megatron's non-Apex path reads a step on every param).
    Returns the per-param states that got a placeholder step, to drop before loading."""
    added = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                if "step" not in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(
                        0.0
                    )  # host: torch Adam keeps a non-capturable step on the CPU
                    added.append(inner.state[p])
    return added


def _keep_restored_steps(optimizer) -> None:
    """megatron-core 0.16 without Apex/TE: the distributed optimizer restores Adam's per-param
    "step" from the common state, then copies the per-param tensors of the checkpoint into
    *every* key of the param state, "step" included, which the param tensors lack (KeyError).
    Hand it the already-restored step so that key copies onto itself."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if orig is None or getattr(orig, "_keeps_step", False):
            continue

        def patched(model_param, tensors, _opt=opt, _orig=orig):
            gi, go = _opt.model_param_group_index_map[model_param]
            state = _opt.optimizer.state[_opt.optimizer.param_groups[gi]["params"][go]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"].clone()}
            return _orig(model_param, tensors)

        cast(Any, patched)._keeps_step = True  # marks the wrapper: a second call leaves it alone
        opt._set_main_param_and_optimizer_states = patched


def _unshare_steps(optimizer) -> None:
    """The non-Apex restore puts one `step` tensor object into every param's state; torch Adam
    increments each param's step in place, so a shared tensor would advance once per param per
    step and corrupt the bias correction. Give every param its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def _load_module(module, sd: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(sd, strict=False)
    # TE/extra-state entries may legitimately differ between writer and reader specs.
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{what}: missing {missing[:4]}, unexpected {unexpected[:4]}")


def load(backend, path: str, *, weights_only: bool = False) -> dict:
    """Collective load; returns the saved `extra`. weights_only restores policy and teacher
    weights only (the optimizer keeps its fresh state: stage transitions)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    root = Path(path)
    if not (root / COMPLETE).is_file():
        raise CheckpointError(f"{path} is not a complete megatron checkpoint (no {COMPLETE} marker)")
    placeholders = [] if weights_only else _ensure_optimizer_state(backend.optimizer)
    state = _sharded(backend, optimizer=not weights_only, is_loading=True)
    for st in placeholders:
        # The saved step comes back through the optimizer's common state, not per param.
        st.pop("step", None)
    try:
        loaded = dist_checkpointing.load(state, str(root))
        common = dist_checkpointing.load_common_state_dict(str(root))
    except Exception as exc:  # dist_checkpointing raises many types for foreign/corrupt dirs
        raise CheckpointError(f"cannot load megatron checkpoint {path}: {type(exc).__name__}: {exc}") from None
    _load_module(_inner(backend.policy), loaded["policy"], "policy")
    if backend.teacher is not None:
        _load_module(backend.teacher, _strip(loaded["teacher"], _TEACHER), "teacher")
        _load_teacher_shadow(backend, root)
    if weights_only:
        backend.optimizer.reload_model_params()
        return dict(common.get("extra", {}))
    _keep_restored_steps(backend.optimizer)
    backend.optimizer.load_state_dict(loaded["optimizer"])
    # The optimizer state holds the fp32 main params ("param" of the fully reshardable format):
    # reloading them from the bf16 model params would round the masters.
    _unshare_steps(backend.optimizer)
    backend.step = int(common.get("step", 0))
    sched = common.get("lr_schedule")
    if sched is not None:
        backend.scheduler = backend._make_scheduler(sched["total"])
        backend.scheduler.load_state_dict(sched["state"])
    layout = json.loads((root / "layout.json").read_text())
    lay = backend.layout
    rng_file = root / "rng" / f"rank{dist.get_rank()}.pt"
    # RNG streams are per rank: they only carry over to the same layout.
    if (layout["tp"], layout["pp"], layout["dp"]) == (lay.tp, lay.pp, lay.dp) and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return dict(common.get("extra", {}))


def convert_to_hf(
    checkpoint: str, hf_model_dir: str, out_dir: str, *, model: str = "policy", vocab_divisor: int = 128
) -> list[str]:
    """Write `model` ("policy" | "teacher") of a megatron checkpoint as an HF model directory.

    Runs in the calling process as a world of one (TP=1, PP=1): dist_checkpointing reshards
    whatever layout wrote the checkpoint. `hf_model_dir` supplies config and tokenizer files
    (the model the run started from). Returns the HF tensor names written."""
    import os as _os

    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from megatron_sdpo.backends.megatron import cpu
    from megatron_sdpo.backends.megatron.launch import free_port
    from megatron_sdpo.backends.megatron.model import ModelOptions, build_model, weight_layout
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, init_distributed, initialize
    from megatron_sdpo.weights.plan import ModelSpec
    from megatron_sdpo.weights.transport import export_hf

    if model not in ("policy", "teacher"):
        raise CheckpointError(f"model must be 'policy' or 'teacher', got {model!r}")
    root = Path(checkpoint)
    if not (root / COMPLETE).is_file():
        raise CheckpointError(f"{checkpoint} is not a complete megatron checkpoint (no {COMPLETE} marker)")
    if not torch.cuda.is_available():
        cpu.install()
    if not dist.is_initialized():
        _os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        init_distributed()
    initialize(ParallelConfig())
    hf_config = AutoConfig.from_pretrained(hf_model_dir)
    spec = ModelSpec.from_hf_config(hf_config)
    options = ModelOptions(vocab_divisor=vocab_divisor, perform_initialization=False)
    gpt = build_model(spec, options)
    prefix = _TEACHER if model == "teacher" else ""
    try:
        loaded = dist_checkpointing.load({model: gpt.sharded_state_dict(prefix=prefix)}, str(root))
    except Exception as exc:
        raise CheckpointError(f"cannot read {model} from {checkpoint}: {type(exc).__name__}: {exc}") from None
    _load_module(gpt, _strip(loaded[model], prefix), model)
    stream = export_hf(gpt, spec, weight_layout(1, 1, options), tp_group=None, pp_group=None, pp_rank=0)
    return sorted(write_hf_dir(stream, hf_model_dir, out_dir, tied=spec.tie_word_embeddings))
