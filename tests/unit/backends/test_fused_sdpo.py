"""The fused-kernel SDPO path of the HF backend equals the logits path (same loss, grads, step)."""

import pytest
import torch

from megatron_sdpo.algorithms.losses import SDPOLoss
from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_qwen3 import TINY_QWEN3, save_tiny_qwen3

from rounding import assert_grads_close, forward_rel


def batch_with_teacher(seed: int, B: int = 5, vocab: int = 300) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 8, (B,), generator=g)]
    r_len = torch.randint(1, 7, (B,), generator=g).tolist()
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in r_len]
    teacher = [
        None if i == 1 else p + torch.randint(3, vocab, (5,), generator=g).tolist() for i, p in enumerate(prompts)
    ]
    T = max(r_len)
    mask = torch.zeros(B, T)
    for i, n in enumerate(r_len):
        mask[i, :n] = 0.0 if teacher[i] is None else 1.0
    rollout = -torch.rand(B, T, generator=g) * 3
    return SequenceBatch(prompts, responses, teacher, {"loss_mask": mask, "rollout_logprobs": rollout})


@pytest.mark.parametrize(
    "alpha, is_clip, temperature", [(0.5, None, 1.0), (1.0, 2.0, 1.0), (0.0, None, 1.0), (0.5, 2.0, 0.7)]
)
def test_fused_path_matches_logits_path(tmp_path, alpha, is_clip, temperature):
    """Also at a rollout temperature: the kernel divides by it (times the loss's own) where the
    logits path divides the logits. Both paths evaluate the same fp32 function in a different
    order: tolerances from tests/rounding.py (the kernel's vocabulary-chunked normalizer adds
    sqrt(V) u to a log-prob, far below the decoder's bound times max|logit|)."""
    path = save_tiny_qwen3(tmp_path / "m", seed=1)
    batch = batch_with_teacher(0)
    rel = forward_rel(TINY_QWEN3, seq_len=32)  # a sample: <= 7 prompt + 5 context + 6 response tokens
    g = torch.Generator().manual_seed(7)
    noise: list[torch.Tensor] = []  # drawn once, for the first backend's teacher
    results = []
    for fused in (False, True):
        backend = HFBackend(path, lr=1e-3, micro_batch_size=2, logit_temperature=temperature)
        with torch.no_grad():
            # A teacher that differs from the student, so the KL is not ~0. The random model's
            # logits reach ~20: student and teacher would be near-disjoint, the JSD saturated at
            # ln 2 and its gradient a small difference of large terms (rounding amplified
            # 10-100x, data-dependent). A head scaled to logits of a few units keeps the
            # divergences mid-range, where the bound of tests/rounding.py applies.
            for model in (backend.policy, backend.teacher):
                model.lm_head.weight.mul_(0.2)
            noise = noise or [0.05 * torch.randn(p.shape, generator=g) for p in backend.teacher.parameters()]
            for p, n in zip(backend.teacher.parameters(), noise, strict=True):
                p.add_(n)
            if not fused:
                # Rollout log-probs near the policy's own (at this temperature): importance
                # weights of O(1) that clip at 2 for some tokens (not ~0 everywhere).
                lp = backend.logprobs(batch)
                max_logit = float(backend.compute(batch, {"logits"})["logits"].abs().max())
                batch.tensors["rollout_logprobs"] = lp + 2 * torch.rand(lp.shape, generator=g) - 1
        loss = SDPOLoss(alpha=alpha, topk=None, is_clip=is_clip, fused=fused, chunk_tokens=4, chunk_vocab=64)
        metrics = backend.train_step(batch, loss)
        # Adam's first moment after one step is (1 - beta1) * grad: the gradients themselves.
        moments = {n: backend.optimizer.state[p]["exp_avg"].clone() for n, p in backend.policy.named_parameters()}
        results.append((metrics, moments))
    (m0, g0), (m1, g1) = results
    assert m0["loss"] > 1e-3  # the comparison is not between two zeros
    if is_clip is not None:
        assert 0.2 < m0["sdpo/is_weight_mean"] < 2.0
    assert m1["loss"] == pytest.approx(m0["loss"], rel=rel * max_logit)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=2 * rel)
    assert_grads_close(g1, g0, 2 * rel)


def test_fused_needs_full_vocabulary():
    from megatron_sdpo.config import load_config

    with pytest.raises(ConfigError, match="kernel.fused_kl=true is the full-vocabulary path"):
        load_config("tiny_sdpo", ["kernel.fused_kl=true", "algorithm.sdpo.topk=20"])
    with pytest.raises(AssertionError, match="full-vocabulary"):  # below the gate
        SDPOLoss(topk=20, fused=True)


def test_max_and_min_metrics_reduce_as_max_and_min(tmp_path):
    from megatron_sdpo.algorithms.losses import GRPOLoss

    path = save_tiny_qwen3(tmp_path / "m", seed=2)
    batch = batch_with_teacher(1, B=6)
    batch.tensors["loss_mask"] = batch.response_mask()
    batch.tensors["advantages"] = torch.linspace(-1, 1, 6)
    m = HFBackend(path, lr=1e-3, micro_batch_size=2).train_step(batch, GRPOLoss(on_policy=True))
    # On-policy: every ratio is exactly 1, in each of the 3 micro-batches.
    assert m["grpo/ratio_max"] == pytest.approx(1.0) and m["grpo/ratio_min"] == pytest.approx(1.0)
    assert m["grpo/ratio_mean"] == pytest.approx(1.0)


def test_rollout_temperature_divides_every_models_logits(tmp_path):
    """logprobs / entropy / teacher and reference log-probs at temperature T are those of
    softmax(logits / T), the logits taken from a backend at temperature 1."""
    import torch.nn.functional as F

    path = save_tiny_qwen3(tmp_path / "m", seed=3)
    batch = batch_with_teacher(2)
    plain = HFBackend(path, lr=1e-3, micro_batch_size=2, with_reference=True)
    hot = HFBackend(path, lr=1e-3, micro_batch_size=2, with_reference=True, logit_temperature=0.6)
    T, mask = batch.max_response_len, batch.response_mask()
    targets = torch.zeros(len(batch), T, dtype=torch.long)
    for i, r in enumerate(batch.response_ids):
        targets[i, : len(r)] = torch.tensor(r)
    want = plain.compute(batch, {"logits", "teacher_logits"})
    got = hot.compute(batch, {"logprobs", "entropy", "teacher_logprobs", "ref_logprobs"})

    def fp32_bound(logits):
        # fp32 log_softmax(z) = z - max - log Σ exp(z - max): the division by T and each of the
        # few roundings after it err by O(eps32 · |z|), so the bound scales with the largest
        # |logit / T| (log-probs near 27 once erred by 1.006e-5 against a fixed 1e-5).
        return 16 * torch.finfo(torch.float32).eps * (float(logits.abs().amax()) / 0.6 + 1.0)

    for logits, key in (
        (want["logits"], "logprobs"),
        (want["teacher_logits"], "teacher_logprobs"),
        (want["logits"], "ref_logprobs"),
    ):
        ref = F.log_softmax(logits.double() / 0.6, -1).gather(-1, targets[..., None])[..., 0]
        torch.testing.assert_close(got[key].double() * mask, ref * mask, atol=fp32_bound(logits), rtol=0)
    logp = F.log_softmax(want["logits"].double() / 0.6, -1)
    torch.testing.assert_close(
        got["entropy"].double() * mask, -(logp.exp() * logp).sum(-1) * mask, atol=fp32_bound(want["logits"]), rtol=0
    )
    assert float(((hot.logprobs(batch) - plain.logprobs(batch)) * mask).abs().max()) > 1e-2
