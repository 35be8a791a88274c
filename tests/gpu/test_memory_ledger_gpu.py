"""The memory ledger against the CUDA allocator (skipped without CUDA): a ~1.2B-parameter Qwen3
shape (random weights, BF16 params, EMA teacher with its fp32 shadow, reference) through one
megatron rank, local spec.

- persistent state after a step (params, fp32 grad buffer, Adam + fp32 main params, teacher,
  shadow, reference) against torch.cuda.memory_allocated: within 10%;
- offload_training_state frees the grads and optimizer bytes the ledger names: within 10%;
- the train phase's peak above that state against the ledger's activations + logits: the ledger
  counts the GPU layers with fused attention (activation_units); the local spec without
  Transformer Engine also saves the attention scores and fp32 norm inputs, so the check is the
  CPU test's bound (at least the ledger, at most three times it) and the ratio is printed.
"""

import pytest
import torch

from megatron_sdpo.models.random_qwen3 import hf_shape

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

SHAPE = dict(
    hf_shape(vocab=151936, hidden=2048, ffn=6144, layers=12, heads=16, kv=8, head_dim=128),
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
MBS, SEQ, PROMPT = 2, 2048, 512


def _batch():
    from megatron_sdpo.interfaces.backend import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: [int(x) for x in torch.randint(3, 150000, (n,), generator=g)]
    prompts = [ids(PROMPT) for _ in range(MBS)]
    b = SequenceBatch(prompts, [ids(SEQ - PROMPT) for _ in range(MBS)], [list(p) for p in prompts], {})
    mask = b.response_mask()
    b.tensors.update(advantages=torch.randn(MBS, generator=g), loss_mask=mask)
    return b


def _worker(model_dir: str) -> dict:
    from megatron_sdpo.algorithms.losses import GRPOLoss
    from megatron_sdpo.planning.memory_census import measured_backend

    be = measured_backend(model_dir, lr=1e-5, micro_batch_size=MBS)
    loss = GRPOLoss(on_policy=True)
    be.train_step(_batch(), loss)  # Adam's state exists from the first step on
    torch.cuda.synchronize()
    out = {"state": torch.cuda.memory_allocated()}
    torch.cuda.reset_peak_memory_stats()
    be.train_step(_batch(), loss)
    torch.cuda.synchronize()
    out["train_peak"] = torch.cuda.max_memory_allocated() - out["state"]
    out["freed"] = be.offload_training_state()
    torch.cuda.synchronize()
    out["offloaded"] = torch.cuda.memory_allocated()
    be.reload_training_state()
    return out


def test_ledger_against_the_allocator(tmp_path):
    import transformers

    from megatron_sdpo.backends.megatron.launch import spawn
    from megatron_sdpo.planning import memory_ledger as ml
    from megatron_sdpo.planning.memory_census import MEASURED_LEDGER
    from megatron_sdpo.weights.plan import ModelSpec

    cfg = transformers.Qwen3Config(**SHAPE)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path))
    (r,) = spawn(_worker, 1, str(tmp_path), timeout_s=600)
    led = ml.build(
        ml.LedgerInputs(
            spec=ModelSpec.from_hf_config(cfg),
            **MEASURED_LEDGER,
            micro_batch_size=MBS,
            seq=SEQ,
            response=SEQ - PROMPT,
            loss_chunk_tokens=1024,
            logit_counts=ml.logit_counts(distills=False, topk=None, is_clip=False, riders=0),
        )
    )
    c = led.categories
    state = sum(c[k] for k in ("params", "grads", "optimizer", "teacher", "teacher_shadow", "reference"))
    train = c["activations"] + c["logits"]
    print(
        f"\nledger vs allocator: state {state / 2**30:.2f} / {r['state'] / 2**30:.2f} GiB, "
        f"train phase {train / 2**30:.2f} / {r['train_peak'] / 2**30:.2f} GiB "
        f"(x{r['train_peak'] / train:.2f}), offload freed {r['freed'] / 2**30:.2f} GiB"
    )
    assert r["state"] == pytest.approx(state, rel=0.10)
    assert r["freed"] == pytest.approx(c["grads"] + c["optimizer"], rel=0.10)
    assert r["state"] - r["offloaded"] == pytest.approx(c["grads"] + c["optimizer"], rel=0.10)
    assert train <= r["train_peak"] <= 3 * train
