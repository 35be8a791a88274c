"""The reference code's teacher options in the HF backend, against their formulas computed here
with separately loaded models: teacher initialisation (teacher <- alpha * checkpoint + (1 -
alpha) * student, SDPO-CL `teacher_init_alpha`) and the trust-region teacher (teacher logits =
lerp(teacher, student, mix) on the teacher's input, lasgroup `TrustRegionTeacher`)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_qwen3 import save_tiny_qwen3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    student = save_tiny_qwen3(tmp_path_factory.mktemp("student"), seed=3)
    ckpt = save_tiny_qwen3(tmp_path_factory.mktemp("ckpt"), seed=4)
    return student, ckpt


def _batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 6, 3)]
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 2, 4)]
    teacher = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 7, 8)]
    return SequenceBatch(prompts, responses, teacher, {})


def _logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), V] fp32 logits predicting each response token, one unpadded sequence."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + response])).logits[0].float()
    return out[len(prompt) - 1 : -1]


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_teacher_init_blends_the_checkpoint_into_the_student(dirs, alpha):
    student_dir, ckpt_dir = dirs
    be = HFBackend(student_dir, lr=1e-3, micro_batch_size=4, teacher_init=(str(ckpt_dir), alpha))
    s = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).state_dict()
    c = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).state_dict()
    got = be.teacher.state_dict()
    for name, t in got.items():
        want = alpha * c[name] + (1.0 - alpha) * s[name]
        # One fp32 rounding of a two-term sum: within a few ulps of the largest term.
        tol = 4 * torch.finfo(torch.float32).eps * max(float(c[name].abs().max()), float(s[name].abs().max()), 1e-30)
        assert torch.allclose(t, want, rtol=0, atol=tol), name
    # The student itself is untouched.
    for name, p in be.policy.state_dict().items():
        assert torch.equal(p, s[name]), name


def test_teacher_init_from_a_missing_checkpoint_is_a_clear_error(dirs, tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        HFBackend(dirs[0], lr=1e-3, micro_batch_size=4, teacher_init=(str(tmp_path / "nope"), 0.5))


@pytest.mark.parametrize("mix", [0.0, 0.3, 1.0])
def test_trust_region_teacher_mixes_teacher_and_student_logits(dirs, mix):
    student_dir, ckpt_dir = dirs
    # The teacher holds the checkpoint (init alpha 1), so teacher and student differ.
    be = HFBackend(student_dir, lr=1e-3, micro_batch_size=2, teacher_init=(str(ckpt_dir), 1.0), teacher_logit_mix=mix)
    batch = _batch()
    got = be.logprobs(batch, model="teacher")
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    for i, (tp, r) in enumerate(zip(batch.teacher_prompt_ids, batch.response_ids, strict=True)):
        logits = (1.0 - mix) * _logits(teacher, tp, r) + mix * _logits(student, tp, r)
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(got[i, : len(r)], want, rtol=1e-5, atol=1e-5)
    # The loss path reads the same mixed logits.
    out = be.compute(batch, {"teacher_logprobs"})
    torch.testing.assert_close(out["teacher_logprobs"] * batch.checked().tensors["response_mask"], got)


def test_trust_region_mix_must_be_a_weight(dirs):
    # Users meet the bound in validation (teacher.trust_region_mix, test_reference_options.py);
    # a caller building the backend by hand meets the assert.
    with pytest.raises(AssertionError):
        HFBackend(dirs[0], lr=1e-3, micro_batch_size=2, teacher_logit_mix=1.5)
