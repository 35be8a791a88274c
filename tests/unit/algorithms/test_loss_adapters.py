"""LossFn adapters: declared requirements, tensor plumbing and micro-batch invariance."""

import pytest
import torch

from megatron_sdpo.algorithms.grpo import policy_loss
from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss, metric_reduce
from megatron_sdpo.algorithms.sdpo import importance_weights, token_distillation_loss
from megatron_sdpo.interfaces.backend import REQUIRES, LossFn

B, T, V, H = 5, 6, 29, 8
K = 7  # top-k of the "topk_logprobs" outputs


class TinyPolicy(torch.nn.Module):
    """Stand-in for a backend's model: per-token hidden states -> logits."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.head = torch.nn.Parameter(torch.randn(H, V, generator=g) * 0.5)

    def forward(self, hidden, ids):
        logits = hidden @ self.head
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
        return logits, logprobs


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    teacher_hidden = hidden + 0.3 * torch.randn(B, T, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([6, 3, 5, 1, 4])
    resp = (torch.arange(T)[None] < lengths[:, None]).float()
    has_ctx = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    tensors = {
        "advantages": torch.randn(B, generator=g),
        "old_logprobs": -torch.rand(B, T, generator=g) * 3,
        "rollout_logprobs": -torch.rand(B, T, generator=g) * 3,
        "loss_mask": resp,
        "distill_mask": resp * has_ctx[:, None],
    }
    return hidden, teacher_hidden, ids, tensors


def _outputs(model, teacher, hidden, teacher_hidden, ids, requires):
    logits, logprobs = model(hidden, ids)
    with torch.no_grad():
        t_logits, t_logprobs = teacher(teacher_hidden, ids)
    available = {
        "logits": logits,
        "logprobs": logprobs,
        "teacher_logits": t_logits,
        "teacher_logprobs": t_logprobs,
        "ref_logprobs": t_logprobs - 0.1,
    }
    # What a vocab-sharded backend hands over: the student's top-K ids' log-probabilities.
    ids_k = logits.detach().topk(K, dim=-1).indices
    available["topk_logprobs"] = torch.log_softmax(logits, -1).gather(-1, ids_k)
    available["teacher_topk_logprobs"] = torch.log_softmax(t_logits, -1).gather(-1, ids_k)
    return {k: available[k] for k in requires}


def _train_grad(loss_fn, micro_batches):
    """What a backend does: global normalizer once, loss shares summed over micro-batches."""
    hidden, teacher_hidden, ids, tensors = _batch()
    model, teacher = TinyPolicy(1), TinyPolicy(2)
    normalizer = loss_fn.global_normalizer(tensors)
    total = 0.0
    for idx in micro_batches:
        outs = _outputs(model, teacher, hidden[idx], teacher_hidden[idx], ids[idx], loss_fn.requires)
        loss, metrics = loss_fn(outs, {k: v[idx] for k, v in tensors.items()}, normalizer)
        (loss * 1.3).backward()
        total = total + loss.detach()
    return total, model.head.grad


@pytest.mark.parametrize(
    "make",
    [
        lambda: GRPOLoss(kl_coef=0.1, tis_cap=2.0),
        lambda: SDPOLoss(alpha=0.5, topk=7, mask_key="distill_mask"),
        lambda: SDPOLoss(alpha=0.5, topk=K, mask_key="distill_mask", topk_source="shards"),
        lambda: SDPOLoss(variant="sampled", alpha=1.0, mask_key="distill_mask"),
        lambda: HybridLoss(SDPOLoss(alpha=1.0, topk=None, mask_key="distill_mask"), GRPOLoss(), lam=0.5),
    ],
    ids=["grpo", "sdpo_topk", "sdpo_topk_shards", "sdpo_sampled", "hybrid"],
)
def test_micro_batch_split_gives_the_full_batch_loss_and_gradient(make):
    loss_fn = make()
    assert isinstance(loss_fn, LossFn) and loss_fn.requires <= REQUIRES
    full, g_full = _train_grad(loss_fn, [list(range(B))])
    split, g_split = _train_grad(loss_fn, [[0, 1], [2], [3, 4]])
    torch.testing.assert_close(split, full)
    torch.testing.assert_close(g_split, g_full)
    assert g_full.abs().sum() > 0


@pytest.mark.parametrize("alpha, add_tail", [(0.0, True), (0.5, False), (1.0, True)])
def test_topk_from_shards_equals_topk_from_logits(alpha, add_tail):
    kw = dict(alpha=alpha, topk=K, add_tail=add_tail, mask_key="distill_mask")
    a, g_a = _train_grad(SDPOLoss(**kw), [[0, 1, 2], [3, 4]])
    b, g_b = _train_grad(SDPOLoss(**kw, topk_source="shards"), [[0, 1, 2], [3, 4]])
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_b, g_a, rtol=1e-5, atol=1e-7)
    with pytest.raises(AssertionError, match="topk_source"):  # the registry never builds it
        SDPOLoss(topk=None, topk_source="shards")


def test_requirements_follow_the_configuration():
    assert GRPOLoss().requires == {"logprobs"}
    assert GRPOLoss(kl_coef=0.01).requires == {"logprobs", "ref_logprobs"}
    assert SDPOLoss().requires == {"logits", "teacher_logits", "logprobs"}
    assert SDPOLoss(is_clip=None).requires == {"logits", "teacher_logits"}
    assert SDPOLoss(variant="sampled", alpha=1.0).requires == {"logprobs", "teacher_logprobs"}
    hybrid = HybridLoss(SDPOLoss(is_clip=None), GRPOLoss(kl_coef=0.1), lam=1.0)
    assert hybrid.requires == {"logits", "teacher_logits", "logprobs", "ref_logprobs"}


def test_adapters_compute_exactly_the_pure_functions():
    hidden, teacher_hidden, ids, tensors = _batch(3)
    model, teacher = TinyPolicy(4), TinyPolicy(5)
    outs = _outputs(model, teacher, hidden, teacher_hidden, ids, REQUIRES - {"entropy", "fused_kl"})
    assert outs["topk_logprobs"].shape == (B, T, K)
    grpo = GRPOLoss(clip_low=0.1, clip_high=0.3, tis_cap=1.5)
    n = grpo.global_normalizer(tensors)
    assert n.dtype == torch.float32 and n.item() == tensors["loss_mask"].sum().item()
    got, _ = grpo(outs, tensors, n)
    want, _ = policy_loss(
        outs["logprobs"],
        tensors["old_logprobs"],
        tensors["advantages"],
        tensors["loss_mask"],
        normalizer=n,
        clip_low=0.1,
        clip_high=0.3,
        rollout_logprobs=tensors["rollout_logprobs"],
        tis_cap=1.5,
    )
    torch.testing.assert_close(got, want)
    sdpo = SDPOLoss(alpha=0.0, topk=None, is_clip=2.0, mask_key="distill_mask")
    n = sdpo.global_normalizer(tensors)
    got, metrics = sdpo(outs, tensors, n)
    w = importance_weights(outs["logprobs"], tensors["rollout_logprobs"], clip=2.0)
    want, _ = token_distillation_loss(
        outs["logits"], outs["teacher_logits"], tensors["distill_mask"], alpha=0.0, is_weights=w, normalizer=n
    )
    torch.testing.assert_close(got, want)
    assert "sdpo/is_weight_mean" in metrics
    hybrid = HybridLoss(sdpo, grpo, lam=0.3)
    norms = hybrid.global_normalizer(tensors)
    assert norms.shape == (2,)
    got, metrics = hybrid(outs, tensors, norms)
    g_loss, _ = grpo(outs, tensors, norms[0])
    s_loss, _ = sdpo(outs, tensors, norms[1])
    torch.testing.assert_close(got, 0.3 * g_loss + 0.7 * s_loss)
    assert {"grpo/clip_frac", "sdpo/loss_per_token", "hybrid/grpo_loss"} <= set(metrics)
    on_policy, _ = GRPOLoss(on_policy=True)(outs, {k: v for k, v in tensors.items() if k != "old_logprobs"}, n)
    assert torch.isfinite(on_policy)


def test_missing_inputs_and_bad_config_are_clear():
    hidden, teacher_hidden, ids, tensors = _batch()
    outs = _outputs(TinyPolicy(1), TinyPolicy(2), hidden, teacher_hidden, ids, {"logprobs"})
    with pytest.raises(KeyError, match="old_logprobs"):
        GRPOLoss()(outs, {k: v for k, v in tensors.items() if k != "old_logprobs"}, torch.tensor(3.0))
    with pytest.raises(KeyError, match="needs model output .logits."):
        SDPOLoss()(outs, tensors, torch.tensor(3.0))
    # Bounds the config gate checks (tests/unit/config/test_bounds.py): asserts below it.
    with pytest.raises(AssertionError, match="alpha = 1"):
        SDPOLoss(variant="sampled", alpha=0.5)
    with pytest.raises(AssertionError, match="fused"):
        SDPOLoss(variant="fused")
    with pytest.raises(AssertionError, match="-0.1"):
        GRPOLoss(clip_low=-0.1)
    with pytest.raises(AssertionError, match="1.5"):
        HybridLoss(SDPOLoss(), GRPOLoss(), lam=1.5)
    with pytest.raises(ValueError, match=r"\[2\] normalizer"):
        HybridLoss(SDPOLoss(), GRPOLoss(), lam=0.1)(outs, tensors, torch.tensor(3.0))


def test_metric_reduce_names():
    assert metric_reduce("grpo/ratio_max") == "max"
    assert metric_reduce("grpo/ratio_min") == "min"
    assert metric_reduce("sdpo/loss_per_token") == "sum"
