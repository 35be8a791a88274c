"""Olmo-3 / Olmo-2 as a megatron-core GPTModel (live, sharded over TP/PP on gloo): logits equal
HF's, HF -> megatron -> HF export is bit-exact, the full-width QK-norm backward is right, and the
megatron backend trains a tiny Olmo-3 like the HF reference.

The tiny Olmo-3 mixes sliding and full-attention layers with a window (3) far below the sequence
length (12), so a wrong window shows in the logits; under PP=2 each stage holds both kinds.
"""

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

SEQ = 12
WINDOW = 3
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_olmo(arch: str = "olmo3", yarn: bool = False, seed: int = 0):
    """A tiny random Olmo with non-trivial norms (so a swapped or misplaced norm changes the
    logits). yarn: YaRN on the full-attention layers with original_max_position_embeddings=4,
    so the scaling matters at SEQ tokens."""
    from test_megatron_convert import tiny_hf

    kw = dict(max_position_embeddings=32, eos_token_id=2)
    if arch == "olmo3":
        kw.update(layer_types=LAYER_TYPES, sliding_window=WINDOW)
        if yarn:
            kw["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4}
    return tiny_hf(arch, False, seed, **kw)


def _olmo_worker(cases: list) -> list:
    """Run each case dict in turn on this world (megatron's parallel state is re-initialized
    between cases: spawning a world costs more than a case on 2 cores)."""
    from megatron_sdpo.backends.megatron.parallel import destroy

    out = []
    for case in cases:
        out.append(_olmo_case(**case))
        destroy()
    return out


def _gather_tp(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts)


def _olmo_case(arch: str, tp: int, pp: int, yarn: bool = False, grad: bool = False, sp: bool = False) -> dict:
    from megatron.core import parallel_state as ps
    from test_megatron_convert import export_check, forward_logits

    from megatron_sdpo.backends.megatron.model import ModelOptions, build_model, weight_layout
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, initialize
    from megatron_sdpo.weights import ModelSpec
    from megatron_sdpo.weights.transport import load_hf

    hf = tiny_olmo(arch, yarn)
    spec = ModelSpec.from_hf_config(hf.config)
    initialize(ParallelConfig(tp=tp, pp=pp))
    options = ModelOptions(sequence_parallel=sp)
    layout = weight_layout(tp, pp, options)
    model = build_model(spec, options)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    hf_sd = hf.state_dict()
    load_hf(model, hf_sd, spec, layout, tp_rank, pp_rank)
    result = {"case": (arch, tp, pp, yarn, sp), "tp": tp_rank, "pp": pp_rank, "config": _window_config(model)}
    if model.config.window_size is not None:
        result["masks_agree"] = _masks_agree(model.config.window_size, WINDOW)

    torch.manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (3, SEQ))
    pos = torch.arange(SEQ).expand_as(ids)
    probe = torch.randn(3, SEQ, spec.vocab_size)  # d(sum(logits * probe)) is the gradient checked
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()

    logits = forward_logits(model, ids)
    if logits is not None:
        result["logit_err"] = (logits[..., : spec.vocab_size] - ref).abs().max().item()
        result["logit_scale"] = ref.abs().max().item()
    # Grads of these are summed over TP by finalize_model_grads under sequence parallelism.
    result["sp_marked"] = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    if grad:
        result.update(_norm_grads(hf, model, ids, pos, probe, spec))
        sharded = model.sharded_state_dict()["decoder.layers.0.self_attention.q_layernorm.weight"]
        result["q_norm_sharding"] = (tuple(sharded.global_shape), tuple(sharded.global_offset))
    result.update(export_check(model, spec, layout, hf_sd))
    return result


def _window_config(model) -> tuple:
    c = model.config
    return (c.window_size, c.window_attn_skip_freq, c.qk_layernorm)


def _masks_agree(window_size: tuple, window: int) -> bool:
    """megatron's sliding-window mask for `window_size` allows exactly the keys HF's mask for
    `window` allows (megatron's mask helper needs the CPU shim: it asks for a CUDA tensor)."""
    from megatron.core.transformer.utils import get_sliding_window_causal_mask
    from transformers.masking_utils import sliding_window_causal_mask_function

    q, kv = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    allowed_hf = sliding_window_causal_mask_function(window)(0, 0, q, kv)
    return torch.equal(~get_sliding_window_causal_mask(SEQ, SEQ, window_size), allowed_hf)


def _norm_grads(hf, model, ids, pos, probe, spec) -> dict:
    """Max |megatron - HF| gradient of sum(logits * probe) w.r.t. every layer's q_norm / k_norm
    weight (TP shards, gathered) and post-norm weights (summed over TP where marked
    sequence_parallel: each rank then saw only its own tokens); PP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    hf.zero_grad()
    (hf(input_ids=ids).logits.float() * probe).sum().backward()
    model.zero_grad()
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(ids, pos, None))
    (logits[..., : spec.vocab_size] * probe).sum().backward()
    params = dict(model.named_parameters())
    errs = {"qk": 0.0, "post": 0.0}
    scale = 0.0
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        for hf_name, mg_name in (
            ("self_attn.q_norm", "self_attention.q_layernorm"),
            ("self_attn.k_norm", "self_attention.k_layernorm"),
            ("post_attention_layernorm", "self_attention.linear_proj.post_layernorm"),
            ("post_feedforward_layernorm", "mlp.linear_fc2.post_layernorm"),
        ):
            want = hf.get_parameter(f"{h}.{hf_name}.weight").grad
            p = params[f"{m}.{mg_name}.weight"]
            if hf_name.startswith("self_attn."):
                got, kind = _gather_tp(p.grad), "qk"
            else:
                got, kind = p.grad.clone(), "post"
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(got, group=ps.get_tensor_model_parallel_group())
            errs[kind] = max(errs[kind], (got - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
    return {"grad_err": errs["qk"], "post_grad_err": errs["post"], "grad_scale": scale}


def _check(results: list, pp: int) -> None:
    last = [r for r in results if r["pp"] == pp - 1]
    assert last
    for r in last:
        # fp32 end to end: only the summation order differs.
        assert r["logit_err"] < 1e-5 * max(1.0, r["logit_scale"]), r
        assert r["logit_scale"] > 0.5, r  # logits large enough for the tolerance to mean something
    for r in results:
        assert r["export_keys_equal"] and r["export_mismatch"] == [], r
        if "grad_err" in r:
            tol = 1e-5 * max(1.0, r["grad_scale"])
            assert r["grad_scale"] > 1e-2 and r["grad_err"] < tol and r["post_grad_err"] < tol, r


def test_world1_olmo3_default_and_yarn_and_olmo2():
    from megatron_sdpo.backends.megatron.launch import spawn

    cases = [dict(arch="olmo3", tp=1, pp=1), dict(arch="olmo3", tp=1, pp=1, yarn=True), dict(arch="olmo2", tp=1, pp=1)]
    (rank0,) = spawn(_olmo_worker, 1, cases, timeout_s=240)
    for r in rank0:
        _check([r], 1)
    # HF window 3 = the query and the 2 keys before it: megatron's (left=2, right=0) on layers 1, 3.
    assert rank0[0]["config"] == ((WINDOW - 1, 0), [1, 0, 1, 0], False)
    assert rank0[0]["masks_agree"]
    assert rank0[2]["config"] == (None, None, False)  # Olmo-2: no sliding layers


def test_world2_tp2_with_norm_grads_sequence_parallel_and_pp2_with_yarn():
    from megatron_sdpo.backends.megatron.launch import spawn

    cases = [
        dict(arch="olmo3", tp=2, pp=1, grad=True),
        dict(arch="olmo3", tp=2, pp=1, yarn=True, sp=True, grad=True),
        dict(arch="olmo3", tp=1, pp=2, yarn=True),
    ]
    ranks = spawn(_olmo_worker, 2, cases, timeout_s=400)
    for i, case in enumerate(cases):
        _check([r[i] for r in ranks], case["pp"])
    # Sequence parallel: the post-norms and the final norm see sequence shards, so their grads
    # must be summed over TP; the q/k norms see whole sequences of their own heads and must not be.
    post = [
        f"decoder.layers.{i}.{m}.post_layernorm.weight"
        for i in range(4)
        for m in ("mlp.linear_fc2", "self_attention.linear_proj")
    ]
    assert ranks[0][1]["sp_marked"] == sorted(post + ["decoder.final_layernorm.weight"])
    assert ranks[0][0]["sp_marked"] == []  # without sequence parallelism nothing is summed
    # The q_norm weight is a TP shard in dist checkpoints too: [64] per layer (layers stacked by
    # megatron), 32 per rank.
    assert [r[0]["q_norm_sharding"] for r in ranks] == [((4, 64), (0, 0)), ((4, 64), (0, 32))]


@pytest.mark.slow
def test_world4_tp2_x_pp2_olmo3_yarn():
    from megatron_sdpo.backends.megatron.launch import spawn

    ranks = spawn(_olmo_worker, 4, [dict(arch="olmo3", tp=2, pp=2, yarn=True)], timeout_s=400)
    _check([r[0] for r in ranks], 2)


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-olmo3")
    tiny_olmo("olmo3", yarn=True).save_pretrained(str(d))
    return str(d)


def test_world2_backend_grpo_and_sdpo_at_tp2_match_hf(olmo_dir):
    """MegatronBackend on the tiny Olmo-3 (YaRN, sliding windows shorter than the rows): GRPO loss
    and gradient norm over 3 steps, and one SDPO step (teacher in the student's schedule), equal
    the HF reference's (the helpers of test_megatron_backend); also with sequence parallelism.
    Olmo's layers take the padded layout only: the backend's default keeps it."""
    from megatron_sdpo.backends.megatron.launch import spawn

    from test_megatron_backend import _backend_worker, _compare, reference

    want = {k: reference(olmo_dir, k) for k in ("grpo", "sdpo_topk")}
    layouts = [(2, 1, 3, "grpo"), (2, 1, 2, "grpo", True), (2, 1, 2, "sdpo_topk", True)]
    ranks = spawn(_backend_worker, 2, olmo_dir, layouts, timeout_s=400)
    for rank in ranks:  # every rank reports the same reduced metrics
        for got, layout in zip(rank, layouts, strict=True):
            _compare(got, want[layout[3]], packed=False)
