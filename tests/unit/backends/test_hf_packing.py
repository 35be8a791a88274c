"""HFBackend with `packing`: the packed rows give the padded layout's per-token outputs, losses,
gradients and step, for GRPO (with the reference model's KL) and SDPO (full vocabulary, top-k
and the fused hidden-state KL, teacher prompts differing from the student's). The same holds
with `share_prompts` (groups of samples with one prompt run once, responses attending to it
through an explicit mask), on batches whose prompts repeat, through SDPA and eager attention.

That transformers turns position ids restarting at 0 into a block-diagonal causal mask when no
attention mask is given (masking_utils.find_packed_sequence_indices) is checked here against an
unpadded forward of each sample alone: a sample attending to another would be off by O(1).

Tolerances. Both layouts evaluate the same fp32 function; they differ only in GEMM shapes, so
in summation order: tests/rounding.py derives the relative bound of the logits from the sums
along the decoder (`forward_rel`), log-probs and losses agree to it times max|logit|, and
gradients to twice it, norm-wise per parameter tensor. The weights after one AdamW step are
compared elementwise with the checker in tests/conftest.py, which derives its own bound from the
gradient differences.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_sdpo.algorithms.losses import GRPOLoss, SDPOLoss
from megatron_sdpo.backends.hf import HFBackend
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.backend import SequenceBatch
from megatron_sdpo.models.random_olmo3 import TINY_OLMO3, save_tiny_olmo3
from megatron_sdpo.models.random_qwen3 import TINY_QWEN3, save_tiny_qwen3

from rounding import assert_grads_close, forward_rel

# A sample of these batches is at most 11 prompt + 5 teacher-context + 7 response tokens.
REL = forward_rel(TINY_QWEN3, seq_len=32)  # ~1.3e-5


def logprob_tol(max_logit: float) -> float:
    return REL * max_logit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=5)


def odd_batch(seed: int, B: int = 7, vocab: int = 300) -> SequenceBatch:
    """Odd lengths, one empty response, teacher prompts longer than the student's (or absent)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, 12, (B,), generator=g).tolist()
    r_len = torch.randint(1, 8, (B,), generator=g).tolist()
    if B > 2:
        r_len[2] = 0
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in p_len]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in r_len]
    teacher = [
        None if i % 3 == 1 else p + torch.randint(3, vocab, (5,), generator=g).tolist() for i, p in enumerate(prompts)
    ]
    T = max(r_len)
    has = torch.tensor([0.0 if t is None else 1.0 for t in teacher])
    mask = torch.zeros(B, T)
    for i, n in enumerate(r_len):
        mask[i, :n] = 1.0
    tensors = {
        "loss_mask": mask * has[:, None],
        "advantages": torch.randn(B, generator=g),
        "rollout_logprobs": -torch.rand(B, T, generator=g) * 3,
    }
    return SequenceBatch(prompts, responses, teacher, tensors)


def grouped_batch(seed: int, groups: int = 3, G: int = 3, vocab: int = 300) -> SequenceBatch:
    """`groups` prompts x G samples each (a GRPO/SDPO batch), odd lengths, one empty response;
    teacher prompts: none, one context shared by a group's samples, or one per sample."""
    g = torch.Generator().manual_seed(seed)
    base = odd_batch(seed, B=groups * G, vocab=vocab)
    prompts = [
        torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (groups,), generator=g)
    ]
    student = [prompts[i // G] for i in range(groups * G)]
    shared_ctx = [p + torch.randint(3, vocab, (4,), generator=g).tolist() for p in prompts]
    teacher = []
    for i in range(groups * G):
        k = i // G
        own = student[i] + torch.randint(3, vocab, (1 + i % 4,), generator=g).tolist()
        teacher.append((None, shared_ctx[k], own)[(i + k) % 3])
    return SequenceBatch(student, base.response_ids, teacher, base.tensors)


LAYOUTS = {"padded": (False, False), "packed": (True, False), "shared": (True, True)}


def backend(model_dir, packing: bool | str, row_tokens: int = 0, mbs: int = 3) -> HFBackend:
    """`packing`: a bool (shared prompts with it) or a LAYOUTS name."""
    pack, share = LAYOUTS[packing] if isinstance(packing, str) else (packing, None)
    be = HFBackend(
        model_dir,
        lr=1e-3,
        micro_batch_size=mbs,
        with_reference=True,
        packing=pack,
        pack_row_tokens=row_tokens,
        share_prompts=share,
    )
    with torch.no_grad():  # a teacher and a reference that differ from the student
        for m, scale in ((be.teacher, 0.05), (be.reference, 0.03)):
            for p in m.parameters():
                p.add_(scale * torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37).view_as(p))
    return be


@pytest.mark.parametrize(
    "layout, row_tokens, attn",
    [
        ("packed", 0, "sdpa"),
        ("packed", 9, "sdpa"),
        ("shared", 0, "sdpa"),
        ("shared", 9, "sdpa"),
        ("shared", 9, "eager"),
    ],
)
def test_packed_logprobs_equal_each_sample_run_alone(model_dir, layout, row_tokens, attn):
    batch = odd_batch(0) if layout == "packed" else grouped_batch(0)
    be = backend(model_dir, layout, row_tokens, mbs=5)
    be.policy.set_attn_implementation(attn)
    _assert_each_sample_alone(be.logprobs(batch), batch, model_dir, REL)


def _assert_each_sample_alone(lp: torch.Tensor, batch: SequenceBatch, model_dir: str, rel: float) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True)):
        assert torch.all(lp[i, len(r) :] == 0)
        if not r:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(lp[i, : len(r)], ref, atol=rel * float(logits.abs().max()), rtol=0)


# Olmo-3's layers: three of four attend within a window of 4 tokens, far below a sample's
# length (up to 23), so a layout whose mask drops the window is off by O(1).
OLMO_WINDOW = 4
REL_OLMO = forward_rel(TINY_OLMO3, seq_len=32)


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory):
    return save_tiny_olmo3(tmp_path_factory.mktemp("olmo3"), seed=5, sliding_window=OLMO_WINDOW)


@pytest.mark.parametrize(
    "layout, attn", [("padded", "sdpa"), ("packed", "sdpa"), ("shared", "sdpa"), ("shared", "eager")]
)
def test_sliding_window_layers_keep_their_window_in_every_layout(olmo_dir, layout, attn):
    """The shared layout hands transformers a prepared mask, which it applies as given to every
    layer: the sliding layers' window must be in it (hf/logits.layer_masks)."""
    batch = grouped_batch(0)
    pack, share = LAYOUTS[layout]
    be = HFBackend(olmo_dir, lr=1e-3, micro_batch_size=5, packing=pack, share_prompts=share, pack_row_tokens=9)
    be.policy.set_attn_implementation(attn)
    _assert_each_sample_alone(be.logprobs(batch), batch, olmo_dir, REL_OLMO)


@pytest.mark.parametrize(
    "layout, row_tokens, mbs",
    [("packed", 0, 3), ("packed", 9, 7), ("packed", 0, 1), ("shared", 0, 9), ("shared", 9, 4), ("shared", 0, 1)],
)
def test_packed_outputs_equal_padded(model_dir, layout, row_tokens, mbs):
    batch = odd_batch(1) if layout == "packed" else grouped_batch(1)
    requires = {"logits", "logprobs", "entropy", "teacher_logits", "teacher_logprobs", "ref_logprobs"}
    out = [backend(model_dir, name, row_tokens, mbs).compute(batch, requires) for name in ("padded", layout)]
    mask = batch.response_mask()
    tol = logprob_tol(float(out[0]["logits"].abs().max()))
    for k in requires - {"logits", "teacher_logits"}:
        torch.testing.assert_close(out[1][k] * mask, out[0][k] * mask, atol=tol, rtol=0, msg=k)
    for k in ("logits", "teacher_logits"):
        m = mask[..., None]
        torch.testing.assert_close(out[1][k] * m, out[0][k] * m, atol=tol, rtol=0, msg=k)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_on_the_response_tokens_only_equal_those_of_the_full_logits(model_dir, layout):
    """Without logits or entropy among the needs, log-probs (policy, teacher, reference) come from
    the output projection of the real response tokens only: the same values there, 0 on the
    padding columns, and the same gradient."""
    batch = odd_batch(3) if layout == "packed" else grouped_batch(3)
    be = backend(model_dir, layout, 0, mbs=len(batch))
    T, mask = batch.max_response_len, batch.response_mask()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    runs = []
    for requires in (
        {"logprobs", "teacher_logprobs", "ref_logprobs"},
        {"logprobs", "teacher_logprobs", "ref_logprobs", "logits", "teacher_logits"},
    ):
        be.policy.zero_grad(set_to_none=True)
        out = be._outputs(batch, T, frozenset(requires), be._head)
        (out["logprobs"] * weights).sum().backward()
        runs.append((out, {n: p.grad.clone() for n, p in be.policy.named_parameters() if p.grad is not None}))
    (fast, g_fast), (full, g_full) = runs
    tol = logprob_tol(float(full["logits"].abs().max()))
    for k in ("logprobs", "teacher_logprobs", "ref_logprobs"):
        assert torch.all(fast[k][mask == 0] == 0), k
        torch.testing.assert_close(fast[k] * mask, full[k] * mask, atol=tol, rtol=0, msg=k)
    assert_grads_close(g_fast, g_full, 2 * REL)


LOSSES = {
    "grpo_kl": lambda: GRPOLoss(on_policy=True, kl_coef=0.1),
    "sdpo_full": lambda: SDPOLoss(alpha=0.5, topk=None, is_clip=2.0),
    "sdpo_topk": lambda: SDPOLoss(alpha=0.5, topk=5, is_clip=None, temperature=1.3),
    "sdpo_fused": lambda: SDPOLoss(alpha=0.5, topk=None, is_clip=None, fused=True, chunk_tokens=4, chunk_vocab=64),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize(
    "layout, row_tokens, mbs", [("packed", 0, 3), ("packed", 9, 7), ("shared", 0, 9), ("shared", 12, 6)]
)
def test_packed_step_equals_padded_step(model_dir, loss, layout, row_tokens, mbs, assert_adam_first_step_close):
    batch = odd_batch(2) if layout == "packed" else grouped_batch(2)
    with torch.no_grad():
        max_logit = float(backend(model_dir, False).compute(batch, {"logits"})["logits"].abs().max())
    tol = logprob_tol(max_logit)
    runs = []
    for name in ("padded", layout):
        be = backend(model_dir, name, row_tokens, mbs)
        metrics = be.train_step(batch, LOSSES[loss]())
        # Adam's exp_avg after one step is (1 - beta1) * (clipped) gradient.
        grads = {n: be.optimizer.state[p]["exp_avg"] / 0.1 for n, p in be.policy.named_parameters()}
        runs.append((metrics, grads, {n: p.detach().clone() for n, p in be.policy.named_parameters()}))
    (m0, g0, p0), (m1, g1, p1) = runs
    assert abs(m0["loss"]) > 1e-4  # the comparison is not between two zeros
    assert m1["loss"] == pytest.approx(m0["loss"], rel=tol, abs=tol)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=2 * REL)
    assert_grads_close(g1, g0, 2 * REL)
    for k in p0:
        assert_adam_first_step_close(p1[k], p0[k], g1[k], g0[k], lr=1e-3, what=f"{k} packed vs padded")


def test_bad_row_tokens_is_a_config_error(model_dir):
    with pytest.raises(ConfigError, match="pack_row_tokens"):
        HFBackend(model_dir, lr=1e-3, micro_batch_size=1, packing=True, pack_row_tokens=-2)
    with pytest.raises(ConfigError, match="share_prompts needs packing"):
        HFBackend(model_dir, lr=1e-3, micro_batch_size=1, packing=False, share_prompts=True)


def test_shared_prompts_need_an_attention_that_takes_a_4d_mask(model_dir):
    be = HFBackend(model_dir, lr=1e-3, micro_batch_size=1, with_teacher=False)
    be.policy.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="share_prompts=false"):
        be._check_mask_support(be.policy.config)
