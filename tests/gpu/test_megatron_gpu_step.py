"""GPU check: one TP=1 megatron training step, TE FP8 when Transformer Engine is present
(and the GPU supports the recipe), BF16 otherwise. Prints which precision ran.

Run on a GPU machine: pytest tests/gpu/test_megatron_gpu_step.py -m gpu -s
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]


def _choose_precision():
    from megatron_sdpo.backends.megatron.precision import PrecisionConfig, have_transformer_engine

    if not have_transformer_engine():
        return PrecisionConfig(params="bfloat16"), "bf16 (Transformer Engine not installed)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (10, 0):
        return PrecisionConfig(params="bfloat16", fp8="mxfp8"), "fp8 mxfp8 (TE)"
    if (major, minor) >= (8, 9):
        return PrecisionConfig(params="bfloat16", fp8="tensorwise"), "fp8 tensorwise (TE)"
    return PrecisionConfig(params="bfloat16"), f"bf16 (sm_{major}{minor} has no FP8)"


def _gpu_worker(model_dir: str) -> dict:
    import time

    from megatron_sdpo.algorithms.losses import GRPOLoss
    from megatron_sdpo.backends.base import SequenceBatch
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions

    precision, what = _choose_precision()
    # FP8 GEMMs need dims that are multiples of 16; pad the vocabulary to 128.
    be = MegatronBackend(model_dir, lr=1e-5, micro_batch_size=4, options=ModelOptions(precision=precision, vocab_divisor=128))
    g = torch.Generator().manual_seed(0)
    prompts = [[int(x) for x in torch.randint(0, 500, (16,), generator=g)] for _ in range(8)]
    responses = [[int(x) for x in torch.randint(0, 500, (16,), generator=g)] for _ in range(8)]
    b = SequenceBatch(prompts, responses, None, {})
    mask = b.response_mask()
    b.tensors.update(advantages=torch.randn(8, generator=g), loss_mask=mask)
    b.tensors["old_logprobs"] = be.logprobs(b) * mask
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = be.train_step(b, GRPOLoss())
    torch.cuda.synchronize()
    return {"what": what, "metrics": m, "step_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name()}


def test_one_tp1_training_step_on_gpu(tmp_path):
    import transformers

    from megatron_sdpo.backends.megatron.launch import spawn

    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path / "m"))
    (r,) = spawn(_gpu_worker, 1, str(tmp_path / "m"), timeout_s=400)
    print(f"\nGPU step on {r['device']}: {r['what']}; {r['step_s']:.3f} s; metrics {r['metrics']}")
    assert torch.isfinite(torch.tensor(r["metrics"]["loss"])) and r["metrics"]["grad_norm"] > 0
    assert r["metrics"]["skipped"] == 0.0
