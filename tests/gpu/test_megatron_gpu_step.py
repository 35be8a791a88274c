"""GPU checks of the megatron backend (skipped without CUDA): TP=1 training steps in BF16 (GRPO,
SDPO through the fused kernel and through vocab-sharded logits), packed (THD) rows against padded
ones, one FP8 step where Transformer Engine and the GPU support it, and a refit of the trained
policy into a colocated vLLM engine.

Run on a GPU machine: bash tests/gpu/run_gpu_checks.sh megatron (or pytest -m gpu tests/gpu -s).
Each check runs in a fresh one-rank world (NCCL) through the project's spawn helper.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]


def _batch(n: int = 8, prompt_len: int = 13, response_len: int = 11, vocab: int = 500, seed: int = 0):
    """n samples; odd lengths so that FP8 has to pad the rows (13 + 11 = 24 -> 32)."""
    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids = lambda k: [int(x) for x in torch.randint(0, vocab, (k,), generator=g)]
    prompts = [ids(prompt_len) for _ in range(n)]
    responses = [ids(response_len) for _ in range(n)]
    teacher = [p + ids(5) for p in prompts]
    b = SequenceBatch(prompts, responses, teacher, {})
    mask = b.response_mask()
    b.tensors.update(advantages=torch.randn(n, generator=g), loss_mask=mask, distill_mask=mask.clone())
    return b


def _fp8_precision():
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig, have_transformer_engine

    if not have_transformer_engine():
        return None, "Transformer Engine not installed"
    cap = torch.cuda.get_device_capability()
    if cap >= (10, 0):
        return PrecisionConfig(params="bfloat16", fp8="mxfp8"), "mxfp8"
    if cap >= (8, 9):
        return PrecisionConfig(params="bfloat16", fp8="tensorwise"), "tensorwise"
    return None, f"sm_{cap[0]}{cap[1]} has no FP8"


def _sdpo(fused: bool):
    from megatron_sdpo.algorithms.losses import SDPOLoss

    return SDPOLoss(variant="logits", alpha=0.5, topk=None, is_clip=2.0, mask_key="distill_mask", fused=fused)


def _steps_worker(model_dir: str, fp8: bool) -> dict:
    import time

    from megatron_sdpo.algorithms.losses import GRPOLoss
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.parallel import destroy
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig

    precision = _fp8_precision()[0] if fp8 else PrecisionConfig(params="bfloat16")
    out = {}
    for source in ("kernel", "shards"):
        be = MegatronBackend(
            model_dir, lr=1e-5, micro_batch_size=4, options=ModelOptions(precision=precision), fused_kl=source
        )
        assert be.device == torch.device("cuda", 0) and be.comm_device.type == "cuda"
        assert be.seq_multiple == (16 if fp8 else 1)
        b = _batch()
        lp = be.logprobs(b)
        assert lp.device.type == "cpu" and torch.isfinite(lp).all()  # returned where the batch lives
        b.tensors["old_logprobs"] = lp
        b.tensors["rollout_logprobs"] = lp
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = {"grpo": be.train_step(b, GRPOLoss()), "sdpo": be.train_step(b, _sdpo(fused=True))}
        torch.cuda.synchronize()
        res["seconds"] = time.perf_counter() - t0
        res["peak_bytes"] = torch.cuda.max_memory_allocated()
        out[source] = res
        del be
        destroy()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    from megatron_sdpo.models.random_qwen3 import hf_shape

    shape = hf_shape(vocab=512, hidden=256, ffn=768, layers=4, heads=4, kv=2, head_dim=64)
    cfg = transformers.Qwen3Config(**shape, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("gpu-qwen3")
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(d))
    return str(d)


def _check_steps(r: dict) -> None:
    for source in ("kernel", "shards"):
        for kind in ("grpo", "sdpo"):
            m = r[source][kind]
            assert m["skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0, (
                source,
                kind,
                m,
            )
    # Same weights, batch and first steps on both paths: BF16 activations give a few 2^-8
    # relative errors per layer, so the paths agree to about 1e-2 (never bit-equal).
    k, s = r["kernel"]["sdpo"], r["shards"]["sdpo"]
    assert abs(k["loss"] - s["loss"]) <= 2e-2 * max(abs(s["loss"]), 1e-3), (k, s)
    assert abs(k["grad_norm"] - s["grad_norm"]) <= 5e-2 * s["grad_norm"], (k, s)


def test_grpo_and_sdpo_steps_bf16_tp1(model_dir):
    from megatron_sdpo.backends.megatron.launch import spawn

    (r,) = spawn(_steps_worker, 1, model_dir, False, timeout_s=600)
    print(
        f"\nBF16 steps on {torch.cuda.get_device_name()}: kernel {r['kernel']['seconds']:.3f} s, "
        f"peak {r['kernel']['peak_bytes'] / 2**20:.0f} MiB; shards {r['shards']['seconds']:.3f} s, "
        f"peak {r['shards']['peak_bytes'] / 2**20:.0f} MiB"
    )
    _check_steps(r)


def test_fp8_steps_when_transformer_engine_is_present(model_dir):
    from megatron_sdpo.backends.megatron.launch import spawn

    precision, what = _fp8_precision()
    if precision is None:
        pytest.skip(f"no FP8 here: {what}")
    (r,) = spawn(_steps_worker, 1, model_dir, True, timeout_s=600)
    print(f"\nFP8 ({what}) steps: kernel {r['kernel']['seconds']:.3f} s, shards {r['shards']['seconds']:.3f} s")
    for source in ("kernel", "shards"):
        for kind in ("grpo", "sdpo"):
            m = r[source][kind]
            assert m["skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0


def _refit_worker(model_dir: str, run_dir: str) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_sdpo.algorithms.losses import GRPOLoss
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig
    from megatron_sdpo.rollout.vllm import VLLMRolloutEngine

    be = MegatronBackend(
        model_dir,
        lr=1e-2,
        micro_batch_size=4,
        with_teacher=False,
        options=ModelOptions(precision=PrecisionConfig(params="bfloat16")),
    )
    b = _batch()
    b.tensors["old_logprobs"] = be.logprobs(b)
    for _ in range(3):  # large steps: the policy leaves the weights on disk
        be.train_step(b, GRPOLoss())
    trainer = be.logprobs(b)
    engine = VLLMRolloutEngine(
        model_dir,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=16,
        run_dir=run_dir,
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.3,
        enable_sleep_mode=False,
    )

    def engine_logprobs() -> torch.Tensor:
        prompts = [TokensPrompt(prompt_token_ids=p + r) for p, r in zip(b.prompt_ids, b.response_ids, strict=True)]
        outs = engine.llm.generate(
            prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False
        )
        rows = torch.zeros_like(trainer)
        for i, (o, p, r) in enumerate(zip(outs, b.prompt_ids, b.response_ids, strict=True)):
            for j, tok in enumerate(r):
                rows[i, j] = o.prompt_logprobs[len(p) + j][tok].logprob
        return rows

    mask = b.response_mask().bool()
    before = (engine_logprobs() - trainer).abs()[mask]
    engine.update_weights(be.export_weights())
    after = (engine_logprobs() - trainer).abs()[mask]
    return {"before_mean": float(before.mean()), "after_mean": float(after.mean()), "after_max": float(after.max())}


@pytest.mark.vllm
def test_refit_into_vllm_matches_the_trainer_logprobs(model_dir, tmp_path):
    from megatron_sdpo.backends.megatron.launch import spawn

    (r,) = spawn(_refit_worker, 1, model_dir, str(tmp_path / "vllm"), timeout_s=600)
    print(
        f"\nrefit: |engine - trainer| logprob mean {r['before_mean']:.4f} before, {r['after_mean']:.4f} after "
        f"(max {r['after_max']:.4f})"
    )
    assert r["before_mean"] > 0.1, r  # the steps moved the policy away from the weights on disk
    # Both sides run the same BF16 weights through different kernels: per-token logprobs differ by
    # a few BF16 roundings of logits of magnitude ~10 (2^-8 each), not by the policy change.
    assert r["after_mean"] <= 0.05 and r["after_max"] <= 0.3, r
    assert r["after_mean"] <= 0.25 * r["before_mean"], r


def _packing_worker(model_dir: str) -> dict:
    """Packed (THD, Transformer Engine's varlen attention) vs padded rows on uneven samples:
    logprobs, then a GRPO and a fused-SDPO step from the same weights."""
    from megatron_sdpo.algorithms.losses import GRPOLoss
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions, resolve_use_te
    from megatron_sdpo.backends.megatron.parallel import destroy
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig
    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(3)
    ids = lambda k: [int(x) for x in torch.randint(0, 500, (k,), generator=g)]
    prompts = [ids(n) for n in (13, 5, 21, 9, 17, 3, 11, 7)]
    responses = [ids(n) for n in (11, 19, 4, 8, 1, 23, 6, 14)]
    out = {}
    for packing in (False, True):
        options = ModelOptions(precision=PrecisionConfig(params="bfloat16"))
        be = MegatronBackend(model_dir, lr=1e-5, micro_batch_size=4, options=options, packing=packing)
        b = SequenceBatch(prompts, responses, [p + ids(5) for p in prompts], {})
        mask = b.response_mask()
        b.tensors.update(advantages=torch.linspace(-1, 1, 8), loss_mask=mask, distill_mask=mask.clone())
        lp = be.logprobs(b)
        b.tensors["old_logprobs"] = lp
        out[packing] = {
            "te": resolve_use_te(options),
            "packed": be.packing,
            "logprobs": lp,
            "mask": mask,
            "grpo": be.train_step(b, GRPOLoss()),
            "sdpo": be.train_step(b, _sdpo(fused=True)),
        }
        del be
        destroy()
        torch.cuda.empty_cache()
    return out


def test_packed_rows_match_padded_rows_bf16(model_dir):
    from megatron_sdpo.backends.megatron.launch import spawn

    (r,) = spawn(_packing_worker, 1, model_dir, timeout_s=600)
    padded, packed = r[False], r[True]
    assert packed["packed"] and not padded["packed"]
    mask = packed["mask"].bool()
    diff = (packed["logprobs"] - padded["logprobs"]).abs()[mask]
    print(
        f"\npacked vs padded (TE: {packed['te']}): |logprob diff| mean {diff.mean():.4f}, max {diff.max():.4f}; "
        f"GRPO loss {packed['grpo']['loss']:.5f} vs {padded['grpo']['loss']:.5f}"
    )
    # Same BF16 weights through different attention kernels (varlen vs padded causal): per-token
    # logprobs differ by a few BF16 roundings of logits of magnitude ~10 (2^-8 each).
    assert diff.mean() <= 0.05 and diff.max() <= 0.3
    for kind in ("grpo", "sdpo"):
        a, b = packed[kind], padded[kind]
        assert a["skipped"] == 0.0 and b["skipped"] == 0.0
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(abs(b["loss"]), 1e-3), (kind, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * b["grad_norm"], (kind, a, b)
