"""HFBackend: layout, losses' inputs, invariance to micro-batching, checkpoints, weights export.

References are plain torch written here: each sample is run unpadded through a separately
loaded copy of the model, and the optimizer step is redone with torch.optim.AdamW.
"""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import CheckpointError, ConfigError, DataError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.interfaces.blend import TeacherBlend
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3

from backend_losses import WeightedNLL


def make_batch(seed: int, B: int = 7, vocab: int = 300, with_teacher: bool = False) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, 9, (B,), generator=g).tolist()
    r_len = torch.randint(1, 7, (B,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in p_len]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in r_len]
    T = max(r_len)
    mask = torch.zeros(B, T)
    for i, n in enumerate(r_len):
        mask[i, :n] = 1.0
    mask[0, 0] = 0.0  # a masked real token: the loss mask is not just the response mask
    teacher = None
    if with_teacher:
        teacher = [
            None if i % 3 == 0 else torch.randint(3, vocab, (n + 4,), generator=g).tolist() for i, n in enumerate(p_len)
        ]
    tensors = {"loss_mask": mask, "advantages": torch.randn(B, generator=g)}
    return SequenceBatch(prompts, responses, teacher, tensors)


def ref_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=3)


def params_of(backend: HFBackend, which: str = "policy") -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in getattr(backend, which).state_dict().items()}


def test_logprobs_match_unpadded_forward(model_dir):
    backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=3)
    batch = make_batch(0)
    lp = backend.logprobs(batch)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert lp.dtype == torch.float32 and lp.shape == (7, batch.max_response_len)
    for i in range(len(batch)):
        n = len(batch.response_ids[i])
        with torch.no_grad():
            ref = ref_logprobs(ref_model, batch.prompt_ids[i], batch.response_ids[i])
        torch.testing.assert_close(lp[i, :n], ref, atol=2e-5, rtol=0)
        assert torch.all(lp[i, n:] == 0)


def test_teacher_reads_teacher_prompts_and_requires_are_honoured(model_dir):
    backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=2, with_reference=True)
    backend.blend_teacher(TeacherBlend.ema(1.0))  # still equal to the policy; now perturb it
    with torch.no_grad():
        for p in backend.teacher.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = make_batch(1, with_teacher=True)
    out = backend.compute(batch, {"teacher_logprobs", "ref_logprobs", "entropy"})
    assert set(out) == {"teacher_logprobs", "ref_logprobs", "entropy"}
    mask = batch.response_mask()
    torch.testing.assert_close(out["teacher_logprobs"] * mask, backend.logprobs(batch, model="teacher"))
    # The reference is the initial weights, i.e. the (untrained) policy.
    torch.testing.assert_close(out["ref_logprobs"] * mask, backend.logprobs(batch, model="policy"))
    teacher_model = backend.teacher
    for i in (1, 2):  # samples with a teacher prompt
        n = len(batch.response_ids[i])
        with torch.no_grad():
            ref = ref_logprobs(teacher_model, batch.teacher_prompt_ids[i], batch.response_ids[i])
        torch.testing.assert_close(out["teacher_logprobs"][i, :n], ref, atol=2e-5, rtol=0)
    logits = backend.compute(batch, {"logits"})["logits"]
    ent = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    torch.testing.assert_close(out["entropy"].double(), ent, atol=1e-5, rtol=1e-5)


def reference_step(model_dir, batch, *, lr, grad_clip):
    """Plain torch: per-sample unpadded forward, loss = sum / global normalizer, AdamW step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss = torch.zeros(())
    m, adv = batch.tensors["loss_mask"], batch.tensors["advantages"]
    for i in range(len(batch)):
        n = len(batch.response_ids[i])
        lp = ref_logprobs(model, batch.prompt_ids[i], batch.response_ids[i])
        loss = loss + (-lp * adv[i] * m[i, :n]).sum()
    loss = loss / m.sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0).step()
    params = {k: v.detach() for k, v in model.state_dict().items()}
    return float(loss.detach()), float(norm), grads, params


def first_moments(backend: HFBackend) -> dict[str, torch.Tensor]:
    """Adam's exp_avg after one step is (1 - beta1) * clipped grad: linear in the gradient."""
    return {k: backend.optimizer.state[p]["exp_avg"] / 0.1 for k, p in backend.policy.named_parameters()}


@pytest.mark.parametrize("grad_clip", [1e9, 0.05])
def test_train_step_matches_reference_and_is_microbatch_invariant(model_dir, grad_clip, assert_adam_first_step_close):
    batch = make_batch(2)
    ref_loss, ref_norm, ref_grads, ref_params = reference_step(model_dir, batch, lr=1e-3, grad_clip=grad_clip)
    results = []
    for mbs in (7, 3):  # one micro-batch vs three (3 + 3 + 1)
        backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=mbs, grad_clip=grad_clip)
        metrics = backend.train_step(batch, WeightedNLL())
        results.append((metrics, params_of(backend), first_moments(backend)))
        assert metrics["tokens"] == float(batch.tensors["loss_mask"].sum())
        assert metrics["skipped"] == 0.0 and backend.step == 1
        assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    (m1, p1, g1), (m3, p3, g3) = results
    assert m1["loss"] == pytest.approx(m3["loss"], rel=1e-6)
    assert m1["grad_norm"] == pytest.approx(m3["grad_norm"], rel=1e-5)
    for k, g in ref_grads.items():
        scale = g.abs().max()
        torch.testing.assert_close(g1[k], g, atol=1e-5 * scale, rtol=1e-4)
        torch.testing.assert_close(g3[k], g1[k], atol=1e-5 * scale, rtol=1e-4)
    # The weights: the same AdamW update as the reference's, up to what the (checked) gradient
    # differences allow after Adam's first-step amplification (bound derived in tests/conftest.py).
    for k in ref_params:
        assert_adam_first_step_close(p1[k], p3[k], g1[k], g3[k], lr=1e-3, what=f"{k} mbs 7 vs 3")
        assert_adam_first_step_close(p1[k], ref_params[k], g1[k], ref_grads[k], lr=1e-3, what=f"{k} vs reference")


def test_checkpoint_round_trip_restores_next_step_exactly(model_dir, tmp_path):
    from megatron_sdpo.interfaces.schedule import LRSchedule

    sched = LRSchedule("linear", warmup_steps=0, min_lr_ratio=0.0)
    a = HFBackend(model_dir, lr=1e-3, micro_batch_size=4, seed=1, lr_schedule=sched)
    a.set_lr_schedule(4)
    a.train_step(make_batch(10), WeightedNLL())
    a.blend_teacher(TeacherBlend.ema(0.5))
    ckpt = tmp_path / "ckpt"
    a.save(str(ckpt), extra={"stage": "math", "step": 1})
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "policy" / "model.safetensors").is_file()
    assert not list(tmp_path.glob("ckpt.tmp-*"))
    draw_a = torch.rand(3)
    m_a = a.train_step(make_batch(11), WeightedNLL())

    b = HFBackend(model_dir, lr=1e-3, micro_batch_size=4, seed=99, lr_schedule=sched)
    assert b.load(str(ckpt)) == {"stage": "math", "step": 1}
    assert b.step == 1
    torch.testing.assert_close(torch.rand(3), draw_a, atol=0, rtol=0)
    # A resumed run offloads its training state around the rollout (the paper presets): the
    # loaded moments must be freeable in place and come back byte for byte.
    moments = first_moments(b)
    assert b.offload_training_state() > 0
    b.reload_training_state()
    assert all(torch.equal(moments[k], v) for k, v in first_moments(b).items())
    m_b = b.train_step(make_batch(11), WeightedNLL())
    assert m_a == m_b and m_b["lr"] == pytest.approx(7.5e-4)  # the schedule resumed at step 1 of 4
    for which in ("policy", "teacher"):
        pa, pb = params_of(a, which), params_of(b, which)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # The saved policy is a plain HF model directory.
    reloaded = AutoModelForCausalLM.from_pretrained(str(ckpt / "teacher"))
    assert torch.equal(reloaded.lm_head.weight, params_of(b, "teacher")["lm_head.weight"])

    # weights_only: weights restored, optimizer state left fresh.
    c = HFBackend(model_dir, lr=1e-3, micro_batch_size=4)
    c.load(str(ckpt), weights_only=True)
    assert c.step == 0 and not c.optimizer.state
    pc, pa0 = (
        params_of(c),
        {k: v for k, v in AutoModelForCausalLM.from_pretrained(str(ckpt / "policy")).state_dict().items()},
    )
    assert all(torch.equal(pc[k], pa0[k]) for k in pc)

    # Overwriting an existing checkpoint works and stays complete.
    b.save(str(ckpt), extra={"step": 2})
    assert b.load(str(ckpt), weights_only=True) == {"step": 2}


def test_bad_checkpoints_raise_checkpoint_error(model_dir, tmp_path):
    a = HFBackend(model_dir, lr=1e-3, micro_batch_size=4)
    good = tmp_path / "good"
    a.save(str(good))
    b = HFBackend(model_dir, lr=1e-3, micro_batch_size=4)

    with pytest.raises(CheckpointError, match="does not exist"):
        b.load(str(tmp_path / "nope"))

    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="partial"):
        b.load(str(partial))

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    f = truncated / "policy" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        b.load(str(truncated))

    bad_opt = tmp_path / "bad_opt"
    shutil.copytree(good, bad_opt)
    (bad_opt / "optimizer.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="optimizer.pt is corrupt"):
        b.load(str(bad_opt))


def test_failed_save_leaves_previous_checkpoint_intact(model_dir, tmp_path, monkeypatch):
    a = HFBackend(model_dir, lr=1e-3, micro_batch_size=4)
    ckpt = tmp_path / "ckpt"
    a.save(str(ckpt), extra={"v": 1})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        a.save(str(ckpt), extra={"v": 2})
    monkeypatch.undo()
    assert not list(tmp_path.glob("ckpt.tmp-*"))
    assert a.load(str(ckpt)) == {"v": 1}
    with pytest.raises(TypeError):
        a.save(str(tmp_path / "x"), extra={"bad": object()})
    assert not (tmp_path / "x").exists()


def test_export_weights_dedups_tied_embeddings(tmp_path):
    tied = save_tiny_qwen3(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    backend = HFBackend(tied, lr=1e-3, micro_batch_size=2)
    names = [n for n, _ in backend.export_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    untied = HFBackend(save_tiny_qwen3(tmp_path / "untied", seed=0), lr=1e-3, micro_batch_size=2)
    assert "lm_head.weight" in dict(untied.export_weights())


def test_teacher_update_actions(model_dir):
    backend = HFBackend(model_dir, lr=1e-2, micro_batch_size=4)
    backend.train_step(make_batch(5), WeightedNLL())
    pol, t0 = params_of(backend), params_of(backend, "teacher")
    backend.blend_teacher(TeacherBlend())
    assert all(torch.equal(t0[k], v) for k, v in params_of(backend, "teacher").items())
    backend.blend_teacher(TeacherBlend.ema(0.25))
    t1 = params_of(backend, "teacher")
    for k in t1:
        torch.testing.assert_close(t1[k], 0.75 * t0[k] + 0.25 * pol[k])
    backend.blend_teacher(TeacherBlend.copy())
    assert all(torch.equal(pol[k], v) for k, v in params_of(backend, "teacher").items())
    ref = HFBackend(model_dir, lr=1e-2, micro_batch_size=4, with_reference=True)
    ref.train_step(make_batch(5), WeightedNLL())
    base, pol = params_of(ref, "reference"), params_of(ref)
    ref.blend_teacher(TeacherBlend(policy=0.5, reference=0.5, teacher=0.0))
    for k, v in params_of(ref, "teacher").items():
        torch.testing.assert_close(v, 0.5 * pol[k] + 0.5 * base[k])
    # Without a resident reference the base can only replace the teacher (loaded from disk).
    with pytest.raises(ConfigError, match="reference resident"):
        backend.blend_teacher(TeacherBlend(policy=0.5, reference=0.5, teacher=0.0))


def test_reset_optimizer_and_user_errors(model_dir, tmp_path):
    backend = HFBackend(model_dir, lr=1e-3, micro_batch_size=4, with_teacher=False)
    backend.train_step(make_batch(6), WeightedNLL())
    assert backend.optimizer.state
    backend.reset_optimizer()
    assert not backend.optimizer.state

    class NeedsTeacher(WeightedNLL):
        requires = frozenset({"teacher_logprobs"})

    with pytest.raises(ConfigError, match="with_teacher=False"):
        backend.train_step(make_batch(6), NeedsTeacher())

    class NeedsFused(WeightedNLL):
        requires = frozenset({"fused_kl"})

    with pytest.raises(ConfigError, match="fused_kl"):
        backend.train_step(make_batch(6), NeedsFused())
    bad = make_batch(6)
    bad.tensors["loss_mask"] = bad.tensors["loss_mask"][:, :-1]
    with pytest.raises(DataError, match="loss_mask"):
        backend.train_step(bad, WeightedNLL())
    with pytest.raises(ConfigError, match="micro_batch_size"):
        HFBackend(model_dir, lr=1e-3, micro_batch_size=0)
    with pytest.raises(ConfigError, match="config.json"):
        HFBackend(str(tmp_path), lr=1e-3, micro_batch_size=1)
    with pytest.raises(ConfigError, match="dtype"):
        HFBackend(model_dir, lr=1e-3, micro_batch_size=1, dtype="fp8")


def test_topk_outputs_give_the_logits_path_step(model_dir):
    """The "topk_logprobs" outputs (what megatron computes from vocab shards) drive the same
    SDPO step as the loss picking the top-k from full logits."""
    from megatron_sdpo.algorithms.losses import SDPOLoss

    batch = make_batch(4, with_teacher=True)
    has = torch.tensor([0.0 if t is None else 1.0 for t in batch.teacher_prompt_ids])
    batch.tensors["loss_mask"] = batch.tensors["loss_mask"] * has[:, None]
    got = []
    for source in ("logits", "shards"):
        be = HFBackend(model_dir, lr=1e-3, micro_batch_size=3, seed=0)
        with torch.no_grad():
            for p in be.teacher.parameters():
                p.add_(0.02 * torch.sin(torch.arange(p.numel(), dtype=torch.float32)).view_as(p))
        m = be.train_step(batch, SDPOLoss(alpha=0.5, topk=5, is_clip=None, temperature=1.3, topk_source=source))
        got.append((m["loss"], m["grad_norm"], m["sdpo/topk_mass_student"]))
    assert got[0][0] > 1e-4
    assert got[1] == pytest.approx(got[0], rel=1e-5)


def test_train_step_reports_the_teacher_forward_time(model_dir):
    """SDPO's teacher forward runs inside train_step: the step reports its seconds (the trainer
    books them as teacher time); a loss without teacher outputs reports none."""
    from megatron_sdpo.algorithms.losses import SDPOLoss

    batch = make_batch(5, with_teacher=True)
    be = HFBackend(model_dir, lr=1e-3, micro_batch_size=3, seed=0)
    sdpo = be.train_step(batch, SDPOLoss(alpha=0.5, topk=None, is_clip=None))
    grpo = be.train_step(batch, WeightedNLL())
    assert sdpo["time/teacher_forward"] > 0.0
    assert grpo["time/teacher_forward"] == 0.0
