"""kernel.fused_kl on the megatron backend: the JSD from final hidden states and the sharded LM
head (fused kernel, no logits) against the JSD from vocab-sharded logits, one optimizer step.

Both paths see the same batch, the same SDPOLoss (full vocabulary, importance weights on, so
the student's logprobs come from the kernel as well) and the same initial weights; loss, grad
norm and the parameters after one Adam step must agree at TP=1 (DP=2), TP=2, TP=2 with
sequence parallelism and PP=2 (the teacher riding in the student's schedule), and at TP=2 with
a rollout temperature (every model's logits divided by it), whose log-probs must also equal the
HF backend's at that temperature.
"""

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

LR = 1e-3
# Both paths are fp32 with different summation orders (tiles vs whole rows): a few ulps per
# reduction over V=131 and H=64, far below this.
TOL = 1e-5
# One Adam step moves every entry by about lr * sign(g); an entry whose gradient is at the
# roundoff level can flip sign (a 2 * lr change). 1% of the update's norm tolerates several
# such entries out of ~1e5 while any real difference in the gradient moves it by far more.
UPDATE_TOL = 1e-2


def _loss():
    from megatron_sdpo.algorithms.losses import SDPOLoss

    return SDPOLoss(
        variant="logits",
        alpha=0.5,
        topk=None,
        is_clip=2.0,
        temperature=0.8,
        mask_key="distill_mask",
        fused=True,
        kernel_impl="chunked",
        chunk_tokens=5,
        chunk_vocab=48,
    )


def _worker(model_dir: str, cases: list) -> list:
    """Per (tp, pp, sequence_parallel, temperature, source): log-probs before the step, loss,
    grad norm and exported weights after it."""
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.model import ModelOptions
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, destroy

    from test_megatron_backend import make_batch

    out = []
    for tp, pp, sp, temp, source in cases:
        be = MegatronBackend(
            model_dir,
            lr=LR,
            micro_batch_size=2,
            parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp),
            options=ModelOptions(sequence_parallel=sp),
            grad_clip=1.0,
            fused_kl=source,
            logit_temperature=temp,
        )
        b = make_batch()
        mask = b.tensors["loss_mask"]
        lp = be.logprobs(b)
        b.tensors["rollout_logprobs"] = (lp + b.tensors["noise"]) * mask
        m = be.train_step(b, _loss())
        weights = {k: v.clone() for k, v in be.export_weights()}
        out.append(
            {
                "loss": m["loss"],
                "grad_norm": m["grad_norm"],
                "weights": weights,
                "device": str(be.device),
                "logprobs": lp.clone(),
            }
        )
        del be
        destroy()
    return out


def test_fused_kernel_matches_the_logits_path_one_step(model_dir):
    from safetensors.torch import load_file

    from megatron_sdpo.backends.hf import HFBackend
    from megatron_sdpo.backends.megatron.launch import spawn

    from test_megatron_backend import make_batch

    layouts = [(1, 1, False, 1.0), (2, 1, False, 1.0), (2, 1, True, 1.0), (1, 2, False, 1.0), (2, 1, False, 0.7)]
    cases = [(*lay, src) for lay in layouts for src in ("shards", "kernel")]
    ranks = spawn(_worker, 2, model_dir, cases, timeout_s=600)
    init = load_file(f"{model_dir}/model.safetensors")
    b = make_batch()
    mask = b.response_mask()
    tempered = HFBackend(model_dir, lr=LR, micro_batch_size=2, logit_temperature=0.7).logprobs(b)
    for rank in ranks:
        # Megatron's log-probs at the rollout temperature, vocab-sharded, equal the HF backend's;
        # at temperature 1 they are measurably different.
        torch.testing.assert_close(rank[-2]["logprobs"] * mask, tempered, atol=TOL, rtol=0)
        assert float(((rank[2]["logprobs"] - rank[-2]["logprobs"]) * mask).abs().max()) > 1e-2
        for i, lay in enumerate(layouts):
            shards, kernel = rank[2 * i], rank[2 * i + 1]
            assert shards["loss"] > 1e-3 and shards["grad_norm"] > 1e-3, (lay, shards["loss"])
            assert abs(kernel["loss"] - shards["loss"]) <= TOL * max(1.0, abs(shards["loss"])), (
                lay,
                kernel["loss"],
                shards["loss"],
            )
            assert abs(kernel["grad_norm"] - shards["grad_norm"]) <= TOL * max(1.0, shards["grad_norm"]), lay
            assert kernel["weights"].keys() == shards["weights"].keys() == init.keys()
            diff = sum(float((kernel["weights"][k] - shards["weights"][k]).pow(2).sum()) for k in init) ** 0.5
            moved = sum(float((shards["weights"][k] - init[k]).pow(2).sum()) for k in init) ** 0.5
            assert moved > LR, (lay, moved)  # the step did move the weights
            assert diff <= UPDATE_TOL * moved, (lay, diff, moved)
