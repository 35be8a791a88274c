"""HF -> megatron GPTModel (live, sharded over TP/PP on gloo) -> logits and HF export.

Each case spawns its own small world; the HF reference runs in the rank itself.
"""

import pytest
import torch

from megatron_sdpo.models.random_qwen3 import hf_shape

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

# The shape of the multi-rank tests' models: 4 layers and 2 KV heads split over TP=2 and PP=2.
SHAPE = hf_shape(vocab=131, hidden=64, ffn=96, layers=4, heads=4, kv=2, head_dim=16)


def tiny_hf(arch: str, tied: bool, seed: int = 0, **overrides):
    """A tiny random HF model (qwen3, llama, olmo2, olmo3) with non-trivial norms (so a swapped
    norm changes the logits); `overrides` change config fields."""
    import transformers

    names = {"qwen3": "Qwen3", "llama": "Llama", "olmo2": "Olmo2", "olmo3": "Olmo3"}[arch]
    kw = dict(
        SHAPE,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        rope_theta=1000.0,
    )
    cfg = getattr(transformers, f"{names}Config")(**{**kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{names}ForCausalLM")(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def _convert_worker(cases: list) -> list:
    """Run each (arch, tied, tp, pp) case in turn on this world (re-initializing megatron's
    parallel state between cases: spawning a world costs more than a case on 2 cores)."""
    from megatron_sdpo.backends.megatron.parallel import destroy

    out = []
    for case in cases:
        out.append(_convert_case(*case))
        destroy()
    return out


def _convert_case(arch: str, tied: bool, tp: int, pp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_sdpo.backends.megatron.model import ModelOptions, build_model, weight_layout
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, initialize
    from megatron_sdpo.weights import ModelSpec
    from megatron_sdpo.weights.transport import load_hf

    hf = tiny_hf(arch, tied)
    spec = ModelSpec.from_hf_config(hf.config)
    initialize(ParallelConfig(tp=tp, pp=pp))
    options = ModelOptions()
    layout = weight_layout(tp, pp, options)
    model = build_model(spec, options)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    hf_sd = hf.state_dict()
    load_hf(model, hf_sd, spec, layout, tp_rank, pp_rank)

    torch.manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (3, 11))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()

    result = {"case": (arch, tied, tp, pp), "tp": tp_rank, "pp": pp_rank}
    logits = forward_logits(model, ids)
    if logits is not None:
        result["padded_vocab"] = logits.shape[-1]
        result["logit_err"] = (logits[..., : spec.vocab_size] - ref).abs().max().item()
        result["logit_scale"] = ref.abs().max().item()
    expect = {k: v for k, v in hf_sd.items() if not (tied and k == "lm_head.weight")}
    result.update(export_check(model, spec, layout, expect))
    return result


def forward_logits(model, ids: torch.Tensor):
    """[b, S, padded V] logits (gathered over TP) of a forward-only schedule on this stage's
    model; None on stages other than the last."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(ids.shape[1]).expand_as(ids)

    def step(data_iter, m):
        x = next(data_iter)
        out = m(x, pos[: x.shape[0]], None)

        def collect(output):
            full = tensor_parallel.gather_from_tensor_model_parallel_region(output)
            return output.sum() * 0.0, {"logits": full.detach().clone()}

        return out, collect

    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([ids]),
            model=[model],
            num_microbatches=1,
            seq_length=ids.shape[1],
            micro_batch_size=ids.shape[0],
            forward_only=True,
        )
    return store[0]["logits"] if ps.is_pipeline_last_stage() else None


def export_check(model, spec, layout, expect: dict) -> dict:
    """Export the model to HF names (collective) and compare with `expect` bit for bit."""
    from megatron.core import parallel_state as ps

    from megatron_sdpo.weights.transport import export_hf

    exported = dict(
        export_hf(
            model,
            spec,
            layout,
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
        )
    )
    return {
        "export_keys_equal": sorted(exported) == sorted(expect),
        "export_mismatch": [k for k in expect if k not in exported or not torch.equal(exported[k], expect[k])],
    }


def _check(results: list, tp: int, pp: int) -> None:
    last = [r for r in results if r["pp"] == pp - 1]
    assert last
    for r in last:
        # fp32 end to end: only the summation order differs.
        assert r["logit_err"] < 1e-5 * max(1.0, r["logit_scale"]), r
        assert r["logit_scale"] > 0.5, r  # logits large enough for the tolerance to mean something
        assert r["padded_vocab"] == 256  # 131 padded to 256 (vocab_divisor 128) whatever tp (gathered here)
    for r in results:
        assert r["export_keys_equal"] and r["export_mismatch"] == [], r


def test_world1_qwen3_and_llama_tied():
    from megatron_sdpo.backends.megatron.launch import spawn

    cases = [("qwen3", False, 1, 1), ("llama", True, 1, 1)]
    (rank0,) = spawn(_convert_worker, 1, cases, timeout_s=240)
    for i, _ in enumerate(cases):
        _check([rank0[i]], 1, 1)


def test_world2_tp2_and_pp2_for_qwen3_and_tied_llama():
    from megatron_sdpo.backends.megatron.launch import spawn

    cases = [("qwen3", False, 2, 1), ("qwen3", False, 1, 2), ("llama", True, 2, 1), ("llama", True, 1, 2)]
    ranks = spawn(_convert_worker, 2, cases, timeout_s=400)
    for i, (_, _, tp, pp) in enumerate(cases):
        _check([r[i] for r in ranks], tp, pp)


@pytest.mark.slow
def test_world4_tp2_x_pp2_qwen3():
    from megatron_sdpo.backends.megatron.launch import spawn

    ranks = spawn(_convert_worker, 4, [("qwen3", False, 2, 2)], timeout_s=400)
    _check([r[0] for r in ranks], 2, 2)
