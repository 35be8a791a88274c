"""MegatronBackend with bf16 params: the EMA teacher is an fp32 shadow blended from the
optimizer's fp32 main params (full copies, or DP-owned ranges under the distributed optimizer),
rounded once into the bf16 teacher; checkpoints keep it, so a resume continues exactly."""

import pytest
import torch

from megatron_sdpo.interfaces.blend import TeacherBlend

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

RATE, STEPS, LR = 0.05, 50, 1e-5
# Identical fp32 lerps on both sides: a few fp32 ULPs of the weight magnitude at most.
FP32_RTOL = 4 * torch.finfo(torch.float32).eps


def _backend(model_dir: str, dist_opt: bool, tp: int = 1):
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig

    return MegatronBackend(
        model_dir,
        lr=LR,
        micro_batch_size=2,
        parallel=ParallelConfig(tp=tp),
        options=ModelOptions(precision=PrecisionConfig(params="bfloat16")),
        distributed_optimizer=dist_opt,
    )


def _batch(be):
    from test_megatron_backend import make_batch

    b = make_batch()
    b.tensors["old_logprobs"] = be.logprobs(b).detach()
    return b


def _ema_worker(model_dir: str, dist_opt: bool, tp: int) -> dict:
    from megatron_sdpo.backends.megatron.parallel import destroy

    from test_megatron_backend import _grpo

    be = _backend(model_dir, dist_opt, tp)
    # A stage's optimizer settings (here the same values) go through without disturbing anything.
    be.configure_optimizer(lr=LR, weight_decay=0.0, grad_clip=1.0, lr_schedule=be.lr_schedule)
    be.set_lr_schedule(None)
    be.blend_teacher(TeacherBlend.copy())
    t0 = [p.detach().clone() for p in be._params("teacher")]
    ref = [w.clone() for w in be.fp32_weights("policy")]  # NaN where another DP rank owns it
    b, loss = _batch(be), _grpo()
    for _ in range(STEPS):
        be.train_step(b, loss)
        be.blend_teacher(TeacherBlend.ema(RATE))
        for r, s in zip(ref, be.fp32_weights("policy"), strict=True):
            r.lerp_(s, RATE)
    shadow = be.fp32_weights("teacher")
    teacher = be._params("teacher")
    owned = sum(int(torch.isfinite(r).sum()) for r in ref)
    scale = max(float(r[torch.isfinite(r)].abs().max()) for r in ref if torch.isfinite(r).any())
    err = max(
        float((s - r)[torch.isfinite(r)].abs().max()) if torch.isfinite(r).any() else 0.0
        for s, r in zip(shadow, ref, strict=True)
    )
    # Each rank checks the elements its shadow holds; the teachers agree across ranks (below).
    cast_exact = all(
        torch.equal(t.detach()[s.isfinite()], s[s.isfinite()].to(torch.bfloat16))
        for t, s in zip(teacher, shadow, strict=True)
    )
    teacher_sum = sum(float(t.detach().double().sum()) for t in teacher)
    shadow_elems = be.teacher_fp32.local.numel()
    moved = sum(int((t.detach() != t_init).sum()) for t, t_init in zip(teacher, t0, strict=True))
    total = sum(t.numel() for t in teacher)
    be.blend_teacher(TeacherBlend.base())  # teacher.reset_at_stage=base: the base model again, in both copies
    base_ok = all(torch.equal(t.detach(), t_init) for t, t_init in zip(be._params("teacher"), t0, strict=True))
    base_ok &= all(
        torch.equal(s[s.isfinite()], t.float()[s.isfinite()])
        for s, t in zip(be.fp32_weights("teacher"), t0, strict=True)
    )
    masters = [w.clone() for w in be.fp32_weights("policy")]
    be.reset_optimizer()  # a stage boundary keeps the fp32 masters
    kept = all(
        torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))
        for x, y in zip(masters, be.fp32_weights("policy"), strict=True)
    )
    destroy()
    return {
        "err": err,
        "tol": FP32_RTOL * scale,
        "cast_exact": cast_exact,
        "moved": moved,
        "total": total,
        "owned": owned,
        "kept": kept,
        "base_ok": base_ok,
        "dtype": str(teacher[0].dtype),
        "teacher_sum": teacher_sum,
        "shadow_elems": shadow_elems,
    }


def _resume_worker(model_dir: str, path: str) -> dict:
    from megatron_sdpo.backends.megatron.parallel import destroy

    from test_megatron_backend import _grpo

    a = _backend(model_dir, True)
    b_, loss = _batch(a), _grpo()
    for _ in range(3):
        a.train_step(b_, loss)
        a.blend_teacher(TeacherBlend.ema(RATE))
    a.save(path)
    for _ in range(2):
        m_a = a.train_step(b_, loss)
        a.blend_teacher(TeacherBlend.ema(RATE))
    want = {w: [x.clone() for x in a.fp32_weights(w)] for w in ("policy", "teacher")}
    del a
    destroy()
    b = _backend(model_dir, True)
    b.load(path)
    for _ in range(2):
        m_b = b.train_step(b_, loss)
        b.blend_teacher(TeacherBlend.ema(RATE))
    same = {"loss": m_a["loss"] == m_b["loss"], "losses": (m_a["loss"], m_b["loss"])}
    for w in ("policy", "teacher"):
        same[w] = (
            max(
                float((torch.nan_to_num(x, nan=7.0) - torch.nan_to_num(y, nan=7.0)).abs().max())
                for x, y in zip(want[w], b.fp32_weights(w), strict=True)
            )
            == 0.0
        )
    destroy()
    return same


def _check(r: dict) -> None:
    assert r["dtype"] == "torch.bfloat16"
    assert r["err"] <= r["tol"], r
    assert r["cast_exact"], r
    assert r["kept"], r
    assert r["base_ok"], r
    # The fp32 EMA crosses bf16 rounding boundaries in many places: the teacher moved.
    assert r["moved"] > 0, r


def test_world1_bf16_teacher_tracks_fp32_ema(model_dir):
    from megatron_sdpo.backends.megatron.launch import spawn

    (r,) = spawn(_ema_worker, 1, model_dir, False, 1, timeout_s=400)
    _check(r)
    assert r["shadow_elems"] == r["total"]


@pytest.mark.slow
def test_world2_dp2_distributed_optimizer_bf16_teacher_tracks_fp32_ema(model_dir):
    from megatron_sdpo.backends.megatron.launch import spawn

    ranks = spawn(_ema_worker, 2, model_dir, True, 1, timeout_s=500)
    for r in ranks:
        _check(r)
        assert r["shadow_elems"] == r["owned"] < r["total"], r  # the shadow holds this rank's share only
    assert sum(r["owned"] for r in ranks) == ranks[0]["total"]  # the DP ranges cover every element once
    assert sum(r["shadow_elems"] for r in ranks) == ranks[0]["total"]  # 1/DP of the bytes each, all covered
    assert ranks[0]["teacher_sum"] == ranks[1]["teacher_sum"]  # the gathered bf16 teacher is one model


@pytest.mark.slow
def test_world2_bf16_resume_is_exact(model_dir, tmp_path):
    from megatron_sdpo.backends.megatron.launch import spawn

    for same in spawn(_resume_worker, 2, model_dir, str(tmp_path / "ck"), timeout_s=500):
        assert same["loss"] and same["policy"] and same["teacher"], same
