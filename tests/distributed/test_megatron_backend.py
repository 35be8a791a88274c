"""MegatronBackend vs plain HF/torch computations on the same batch (fp32, gloo).

The reference is written here: the HF model scores each sample unpadded, the team's loss
adapters compute the loss, torch AdamW + clip_grad_norm_ take the step. The megatron backend
must match loss and gradient norm at every layout, micro-batch count and DP size, on packed
(THD) rows (its default) and on the padded layout.
"""

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

LR = 1e-4
STEPS = 3


def make_batch(vocab: int = 131):
    """Six samples of uneven prompt/response lengths, teacher prompts on four of them."""
    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(7)
    ids = lambda n: [int(x) for x in torch.randint(0, vocab, (n,), generator=g)]
    prompts = [ids(n) for n in (3, 6, 4, 7, 2, 5)]
    responses = [ids(n) for n in (4, 2, 6, 3, 5, 1)]
    teacher = [p + ids(4) if i % 3 else None for i, p in enumerate(prompts)]
    b = SequenceBatch(prompts, responses, teacher, {})
    mask = b.response_mask()
    distill = mask * torch.tensor([0.0 if t is None else 1.0 for t in teacher]).unsqueeze(1)
    b.tensors.update(
        advantages=torch.randn(6, generator=g),
        noise=0.2 * torch.randn(mask.shape, generator=g),
        loss_mask=mask,
        distill_mask=distill,
    )
    return b


def _sdpo_fused():
    """Full-vocabulary SDPO through the fused kernel: the backend feeds it final hidden states
    and the vocab-sharded LM head (no logits)."""
    from megatron_sdpo.algorithms.losses import SDPOLoss

    return SDPOLoss(variant="logits", alpha=0.5, topk=None, is_clip=None, mask_key="distill_mask", fused=True)


def _grpo(kl_coef: float = 0.0):
    from megatron_sdpo.algorithms.losses import GRPOLoss

    return GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=kl_coef)


KL_COEF = 0.5  # large, so that a wrong reference shows in the loss
TOPK = 5


def _sdpo_topk(source: str):
    from megatron_sdpo.algorithms.losses import SDPOLoss

    return SDPOLoss(variant="logits", alpha=0.5, topk=TOPK, is_clip=None, mask_key="distill_mask", topk_source=source)


def _hf_logits(model, prompts, responses, T):
    """[B, T, V] fp32 logits predicting each response token, one unpadded forward per sample."""
    rows = []
    for p, r in zip(prompts, responses, strict=True):
        lg = model(input_ids=torch.tensor([p + r])).logits[0].float()
        out = torch.zeros(T, lg.shape[-1])
        out[: len(r)] = lg[len(p) - 1 : len(p) - 1 + len(r)]
        rows.append(out)
    return torch.stack(rows)


def reference(model_dir: str, kind: str) -> list[tuple[float, float]]:
    """(loss, grad_norm) per step from the HF model, torch AdamW and the team's losses."""
    import copy

    from transformers import AutoModelForCausalLM

    from megatron_sdpo.algorithms.losses import SDPOLoss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher = copy.deepcopy(model).requires_grad_(False)  # also the frozen reference
    b = make_batch()
    T = b.max_response_len
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}],
        lr=LR,
        weight_decay=0.0,
        eps=1e-8,
    )
    with torch.no_grad():
        lg = _hf_logits(model, b.prompt_ids, b.response_ids, T)
        old = (
            torch.log_softmax(lg, -1).gather(-1, torch.tensor(_targets(b, T)).unsqueeze(-1)).squeeze(-1)
            + b.tensors["noise"]
        ) * b.tensors["loss_mask"]
    b.tensors["old_logprobs"] = old
    out = []
    for _ in range(1 if kind.startswith("sdpo") else STEPS):
        lg = _hf_logits(model, b.prompt_ids, b.response_ids, T)
        if kind in ("grpo", "grpo_kl"):
            loss_fn = _grpo(KL_COEF if kind == "grpo_kl" else 0.0)
            lp = torch.log_softmax(lg, -1).gather(-1, torch.tensor(_targets(b, T)).unsqueeze(-1)).squeeze(-1)
            outputs = {"logprobs": lp}
            if kind == "grpo_kl":
                with torch.no_grad():
                    rl = _hf_logits(teacher, b.prompt_ids, b.response_ids, T)
                outputs["ref_logprobs"] = (
                    torch.log_softmax(rl, -1).gather(-1, torch.tensor(_targets(b, T)).unsqueeze(-1)).squeeze(-1)
                )
        else:
            loss_fn = SDPOLoss(variant="logits", alpha=0.5, topk=None, is_clip=None, mask_key="distill_mask")
            if kind == "sdpo_topk":
                loss_fn = _sdpo_topk("logits")
            tprompts = [t if t is not None else p for t, p in zip(b.teacher_prompt_ids, b.prompt_ids, strict=True)]
            with torch.no_grad():
                tl = _hf_logits(teacher, tprompts, b.response_ids, T)
            outputs = {"logits": lg, "teacher_logits": tl}
        loss, _ = loss_fn(outputs, b.tensors, loss_fn.global_normalizer(b.tensors))
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        out.append((float(loss.detach()), float(gn)))
    return out


def _targets(b, T):
    return [r + [0] * (T - len(r)) for r in b.response_ids]


def _backend_worker(model_dir: str, layouts: list) -> list:
    """Per layout (tp, pp, micro_batch_size, kind[, sequence_parallel[, packing]]): the backend's
    (loss, grad_norm) per step, and whether it ran packed rows."""
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, destroy

    results = []
    for tp, pp, mbs, kind, *rest in layouts:
        sp = bool(rest[0]) if rest else False
        packing = rest[1] if len(rest) > 1 else None
        be = MegatronBackend(
            model_dir,
            lr=LR,
            micro_batch_size=mbs,
            parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp),
            options=ModelOptions(sequence_parallel=sp),
            grad_clip=1.0,
            with_reference=kind == "grpo_kl",
            packing=packing,
        )
        b = make_batch()
        lp = be.logprobs(b)
        b.tensors["old_logprobs"] = (lp + b.tensors["noise"]) * b.tensors["loss_mask"]
        loss_fn = {"sdpo": _sdpo_fused, "sdpo_topk": lambda: _sdpo_topk("shards")}.get(
            kind, lambda kind=kind: _grpo(KL_COEF if kind == "grpo_kl" else 0.0)
        )()
        steps = []
        for _ in range(1 if kind.startswith("sdpo") else STEPS):
            m = be.train_step(b, loss_fn)
            steps.append((m["loss"], m["grad_norm"]))
            # Only the teacher's forward is timed (not the reference rider's).
            assert (m["time/teacher_forward"] > 0.0) == kind.startswith("sdpo"), (kind, m)
        results.append((steps, be.packing))
        del be
        destroy()
    return results


@pytest.fixture(scope="module")
def refs(model_dir):
    return {k: reference(model_dir, k) for k in ("grpo", "grpo_kl", "sdpo", "sdpo_topk")}


def _compare(result, want, packed: bool = True, tol_first=1e-5, tol_later=1e-4):
    got, ran_packed = result
    assert ran_packed == packed
    assert len(got) == len(want)
    for i, ((gl, gn), (wl, wn)) in enumerate(zip(got, want, strict=True)):
        tol = tol_first if i == 0 else tol_later
        assert abs(gl - wl) <= tol * max(1.0, abs(wl)), (i, got, want)
        assert abs(gn - wn) <= tol * max(1.0, abs(wn)), (i, got, want)


def _packed(layout: tuple) -> bool:
    """Whether a layout runs packed rows (its packing entry; null means packed on this model)."""
    return layout[5] is not False if len(layout) > 5 else True


def test_reference_is_not_degenerate(refs):
    losses = [loss for loss, _ in refs["grpo"]]
    assert all(g > 1e-3 for _, g in refs["grpo"]) and refs["sdpo"][0][1] > 1e-4
    assert refs["sdpo"][0][0] > 1e-4  # teacher prompts differ: a real distillation signal
    assert refs["sdpo_topk"][0][0] > 1e-4 and abs(refs["sdpo_topk"][0][0] - refs["sdpo"][0][0]) > 1e-4
    assert len(set(losses)) == STEPS  # the policy moves between steps
    # The policy leaves the reference after step 1: the KL term changes the later losses.
    assert refs["grpo_kl"][0][0] == pytest.approx(refs["grpo"][0][0], abs=1e-6)
    assert abs(refs["grpo_kl"][-1][0] - refs["grpo"][-1][0]) > 1e-6


def test_world1_grpo_steps_and_sdpo_match_hf(model_dir, refs):
    from megatron_sdpo.backends.megatron.launch import spawn

    # Packed rows by default; the last two run the padded layout.
    layouts = [
        (1, 1, 2, "grpo"),
        (1, 1, 4, "sdpo"),
        (1, 1, 3, "grpo_kl"),
        (1, 1, 2, "sdpo_topk"),
        (1, 1, 4, "grpo", False, False),
        (1, 1, 3, "sdpo", False, False),
    ]
    (r,) = spawn(_backend_worker, 1, model_dir, layouts, timeout_s=300)
    for got, layout in zip(r, layouts, strict=True):
        _compare(got, refs[layout[3]], packed=_packed(layout))


@pytest.mark.slow
def test_world2_tp2_pp2_dp2_match_hf(model_dir, refs):
    from megatron_sdpo.backends.megatron.launch import spawn

    layouts = [
        (2, 1, 3, "grpo"),
        (2, 1, 2, "sdpo"),
        (2, 1, 4, "sdpo_topk"),
        (1, 2, 4, "grpo"),
        (1, 2, 2, "sdpo"),
        (1, 2, 2, "grpo_kl"),
        (1, 1, 1, "grpo"),
        (1, 1, 2, "sdpo_topk"),
        # Sequence parallelism: norms' grads summed over TP, activations sequence-sharded.
        (2, 1, 2, "grpo", True),
        (2, 1, 3, "sdpo", True),
        (2, 1, 2, "sdpo_topk", True),
        # The padded layout under TP (with SP) and PP.
        (2, 1, 3, "sdpo", True, False),
        (1, 2, 2, "grpo", False, False),
    ]
    ranks = spawn(_backend_worker, 2, model_dir, layouts, timeout_s=500)
    for rank in ranks:  # every rank reports the same reduced metrics
        for got, layout in zip(rank, layouts, strict=True):
            _compare(got, refs[layout[3]], packed=_packed(layout))


@pytest.mark.slow
def test_world4_tp2_x_pp2_matches_hf(model_dir, refs):
    from megatron_sdpo.backends.megatron.launch import spawn

    layouts = [(2, 2, 2, "grpo"), (2, 2, 3, "sdpo"), (2, 2, 2, "sdpo_topk"), (2, 2, 2, "sdpo", True)]
    ranks = spawn(_backend_worker, 4, model_dir, layouts, timeout_s=500)
    for rank in ranks:
        for got, layout in zip(rank, layouts, strict=True):
            _compare(got, refs[layout[3]])


def _mb_batch(vocab: int = 131):
    """Four prompt groups of two samples: four GRPO mini-batches of one group each."""
    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(11)
    ids = lambda n: [int(x) for x in torch.randint(0, vocab, (n,), generator=g)]
    prompts = [p for p in (ids(3), ids(5), ids(4), ids(6)) for _ in range(2)]
    responses = [ids(n) for n in (4, 2, 6, 3, 5, 1, 3, 4)]
    b = SequenceBatch(prompts, responses, None, {})
    b.tensors.update(loss_mask=b.response_mask(), advantages=torch.tensor([1.0, -1.0, -0.5, 0.5, 2.0, -2.0, 1.0, -1.0]))
    return b


MB_LR = 2e-2  # large: after the first mini-batch the ratio leaves the clip range on some tokens


def _mb_loss():
    from megatron_sdpo.algorithms.losses import GRPOLoss

    return GRPOLoss(clip_low=0.2, clip_high=0.28, on_policy=False, dual_clip=3.0)


def _mb_worker(model_dir: str) -> dict:
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.parallel import destroy
    from megatron_sdpo.trainer import minibatch_update

    be = MegatronBackend(model_dir, lr=MB_LR, micro_batch_size=2, grad_clip=1.0, with_teacher=False)
    b = _mb_batch()
    m = minibatch_update(be, b, _mb_loss(), mini_batches=4, group_size=2)
    m["after"] = be.logprobs(b).tolist()
    destroy()
    return m


def test_world1_grpo_four_minibatches_match_hf(model_dir):
    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.backends.megatron.launch import spawn
    from megatron_sdpo.trainer import minibatch_update

    hf = HFBackend(model_dir, lr=MB_LR, micro_batch_size=2, grad_clip=1.0, with_teacher=False)
    b = _mb_batch()
    want = minibatch_update(hf, b, _mb_loss(), mini_batches=4, group_size=2)
    after = hf.logprobs(b)
    (got,) = spawn(_mb_worker, 1, model_dir, timeout_s=300)
    assert want["optimizer_steps"] == got["optimizer_steps"] == 4.0
    assert want["grpo/clip_frac"] > 0 and want["grpo/ratio_max"] > 1.0  # the clip acted
    for key in (
        "loss",
        "grad_norm",
        "grpo/clip_frac",
        "grpo/ratio_mean",
        "grpo/ratio_max",
        "grpo/ratio_min",
        "grpo/pg_loss",
    ):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (key, got[key], want[key])
    torch.testing.assert_close(torch.tensor(got["after"]), after, rtol=1e-4, atol=1e-4)


def _reads_worker(model_dir: str) -> dict:
    import megatron_sdpo.backends.megatron.backend as backend_mod
    from megatron_sdpo.backends.megatron.parallel import destroy

    reads = []
    real = backend_mod.load_hf

    def counting(model, *args, **kwargs):
        reads.append(type(model).__name__)
        return real(model, *args, **kwargs)

    backend_mod.load_hf = counting
    be = backend_mod.MegatronBackend(model_dir, lr=MB_LR, micro_batch_size=2, with_teacher=True, with_reference=True)
    same = {
        w: all(torch.equal(a, b) for a, b in zip(be._params("policy"), be._params(w), strict=True))
        for w in ("teacher", "reference")
    }
    frozen = not any(p.requires_grad for w in ("teacher", "reference") for p in be._params(w))
    destroy()
    return {"reads": reads, "same": same, "frozen": frozen}


def test_world1_reads_the_checkpoint_once_for_policy_teacher_and_reference(model_dir):
    from megatron_sdpo.backends.megatron.launch import spawn

    (r,) = spawn(_reads_worker, 1, model_dir, timeout_s=300)
    assert len(r["reads"]) == 1, r  # the policy's; teacher and reference copy it
    assert r["same"] == {"teacher": True, "reference": True} and r["frozen"], r
