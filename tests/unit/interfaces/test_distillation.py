"""The typed distillation spec: what each loss declares, what a backend may ask of it."""

import dataclasses

import pytest

from megatron_sdpo.algorithms.losses import GRPOLoss, HybridLoss, SDPOLoss
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.distillation import DistillationSpec, distillation_of


def test_each_loss_declares_its_spec_once():
    assert GRPOLoss().distillation is None and GRPOLoss(on_policy=True).on_policy
    sdpo = SDPOLoss(
        alpha=0.3,
        topk=7,
        temperature=1.3,
        mask_key="distill_mask",
        is_clip=None,
        topk_source="shards",
        kernel_impl="chunked",
        chunk_tokens=16,
        chunk_vocab=100,
    )
    assert sdpo.distillation == DistillationSpec(
        alpha=0.3,
        temperature=1.3,
        topk=7,
        topk_source="shards",
        mask_key="distill_mask",
        fused=False,
        kernel_impl="chunked",
        chunk_tokens=16,
        chunk_vocab=100,
    )
    assert sdpo.on_policy is False
    full = SDPOLoss(topk=None, fused=True).distillation
    assert full.topk_source == "full" and full.fused and full.topk is None
    # The sampled variant scores sampled tokens only: no top-k to compute, whatever topk says.
    assert SDPOLoss(variant="sampled", alpha=1.0, topk=100).distillation.topk_source == "full"
    hybrid = HybridLoss(sdpo, GRPOLoss(on_policy=True), lam=0.5)
    assert hybrid.distillation is sdpo.distillation and hybrid.on_policy is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        sdpo.distillation.alpha = 0.5


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(alpha=0.5, temperature=0.0), "temperature"),
        (dict(alpha=0.5, topk=0, topk_source="logits"), "topk"),
        (dict(alpha=0.5, topk=True, topk_source="logits"), "topk"),
        (dict(alpha=0.5, topk=5), "full"),  # a top-k needs a source other than "full"
        (dict(alpha=0.5, topk_source="shards"), "full"),  # and "full" goes with no top-k
        (dict(alpha=0.5, topk=5, topk_source="vocab"), "topk_source"),
        (dict(alpha=0.5, topk=5, topk_source="logits", fused=True), "full-vocabulary"),
        (dict(alpha=0.5, chunk_tokens=0), "chunk"),
    ],
)
def test_bad_specs_are_one_line_config_errors(kwargs, text):
    with pytest.raises(ConfigError, match=text):
        DistillationSpec(**kwargs)


def test_a_backend_gets_the_spec_only_for_an_output_it_declares():
    topk = SDPOLoss(topk=5, topk_source="shards", is_clip=None)
    fused = SDPOLoss(topk=None, fused=True, is_clip=None)
    assert distillation_of(topk, "topk_logprobs") is topk.distillation
    assert distillation_of(fused, "fused_kl") is fused.distillation
    with pytest.raises(ConfigError, match="distilling loss"):
        distillation_of(GRPOLoss(), "fused_kl")
    with pytest.raises(ConfigError, match="distilling loss"):
        distillation_of(None, "topk_logprobs")
    with pytest.raises(ConfigError, match="fused"):
        distillation_of(topk, "fused_kl")
    with pytest.raises(ConfigError, match="top-k"):
        distillation_of(fused, "topk_logprobs")
