"""The megatron step's logits at a temperature (vocab_parallel.tempered): no copy at 1.0."""

import pytest
import torch

pytestmark = pytest.mark.megatron


def test_temperature_one_keeps_the_logits_and_others_divide():
    from megatron_sdpo.backends.vocab_parallel import tempered as _tempered

    x = torch.randn(5, 7, requires_grad=True)
    assert _tempered(x, 1.0) is x  # no second fp32 [tokens, vocab / TP] tensor through the backward
    y = _tempered(x, 0.7)
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(y, x / 0.7)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 1 / 0.7))
