"""backend.megatron.loss_chunk_tokens: the logits path's per-token statistics over chunks of
response tokens, each recomputed in backward (step_loss.py), against the whole micro-batch at
once: the same loss, grad norm and weights after one Adam step.

At TP=2 with the paper presets' loss (top-k distillation with importance weights) and the
reference's k3 KL riding along (two riders), and with the full-vocabulary JSD from shards at a
distillation temperature; at TP=1 x DP=2 GRPO with the KL. A micro-batch holds 2 samples of up
to 6 response tokens: chunks of 5 split every micro-batch, some of them inside a sample.
"""

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

LR = 1e-3
CHUNK = 5
# Chunked and whole compute each token's statistics with the same fp32 operations over the same
# vocabulary shard; only the shapes the reductions see differ: a few ulps per value.
TOL = 1e-5
# One Adam step moves every entry by about lr * sign(g); an entry whose gradient is at the
# roundoff level can flip sign. 1% of the update's norm tolerates several such entries.
UPDATE_TOL = 1e-2


def _losses():
    from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss

    topk = SDPOLoss(variant="logits", alpha=0.5, topk=7, is_clip=2.0, mask_key="distill_mask", topk_source="shards")
    return {
        "hybrid_topk_kl": lambda: HybridLoss(sdpo=topk, grpo=GRPOLoss(on_policy=False, kl_coef=0.1), lam=0.5),
        "full_jsd_t08": lambda: SDPOLoss(
            variant="logits", alpha=0.5, topk=None, is_clip=2.0, temperature=0.8, mask_key="distill_mask", fused=True
        ),
        "grpo_kl": lambda: GRPOLoss(on_policy=False, kl_coef=0.1),
    }


def _worker(model_dir: str, cases: list) -> list:
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, destroy

    from test_megatron_backend import make_batch

    out = []
    for tp, loss, chunk in cases:
        be = MegatronBackend(
            model_dir,
            lr=LR,
            micro_batch_size=2,
            parallel=ParallelConfig(tp=tp),
            grad_clip=1.0,
            with_reference=True,
            fused_kl="shards",
            loss_chunk_tokens=chunk,
        )
        b = make_batch()
        lp = be.logprobs(b)
        b.tensors["old_logprobs"] = b.tensors["rollout_logprobs"] = (lp + b.tensors["noise"]) * b.tensors["loss_mask"]
        m = be.train_step(b, _losses()[loss]())
        out.append(
            {"loss": m["loss"], "grad_norm": m["grad_norm"], "weights": {k: v.clone() for k, v in be.export_weights()}}
        )
        del be
        destroy()
    return out


def test_chunked_loss_statistics_match_the_whole_micro_batch(model_dir):
    from safetensors.torch import load_file

    from megatron_sdpo.backends.megatron.launch import spawn

    setups = [(2, "hybrid_topk_kl"), (2, "full_jsd_t08"), (1, "grpo_kl")]
    cases = [(tp, loss, chunk) for tp, loss in setups for chunk in (CHUNK, 0)]
    ranks = spawn(_worker, 2, model_dir, cases, timeout_s=600)
    init = load_file(f"{model_dir}/model.safetensors")
    for rank in ranks:
        for i, setup in enumerate(setups):
            chunked, whole = rank[2 * i], rank[2 * i + 1]
            assert whole["loss"] != 0.0 and whole["grad_norm"] > 1e-3, (setup, whole)
            assert abs(chunked["loss"] - whole["loss"]) <= TOL * max(1.0, abs(whole["loss"])), (setup, chunked, whole)
            assert abs(chunked["grad_norm"] - whole["grad_norm"]) <= TOL * max(1.0, whole["grad_norm"]), setup
            diff = sum(float((chunked["weights"][k] - whole["weights"][k]).pow(2).sum()) for k in init) ** 0.5
            moved = sum(float((whole["weights"][k] - init[k]).pow(2).sum()) for k in init) ** 0.5
            assert moved > LR, (setup, moved)
            assert diff <= UPDATE_TOL * moved, (setup, diff, moved)


def test_negative_chunk_is_a_config_error(model_dir):
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.errors import ConfigError

    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        MegatronBackend(model_dir, lr=LR, micro_batch_size=2, loss_chunk_tokens=-1)
