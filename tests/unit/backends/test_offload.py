"""StateOffload: storages freed in place and restored byte for byte, views and identities kept."""

import torch

from megatron_sdpo.backends.offload import StateOffload


def test_offload_frees_copies_and_restores_in_place():
    weights = torch.randn(6)
    moments = {"exp_avg": torch.randn(5, 3), "exp_avg_sq": torch.rand(7)}
    shared = weights[2:4]  # a view of a kept storage (e.g. a main param viewing the weights)
    grad_buffer = torch.randn(10)
    grad_view = grad_buffer[3:8]  # megatron's param.main_grad is a view of the grad buffer
    before = {k: v.clone() for k, v in moments.items()}
    ids = {k: id(v) for k, v in moments.items()}

    off = StateOffload(torch.device("cpu"))
    freed = off.offload([*moments.values(), shared], [grad_buffer], keep=[weights])
    assert freed == (15 + 7 + 10) * 4 and off.active and off.host_bytes == (15 + 7) * 4
    assert all(v.untyped_storage().nbytes() == 0 for v in moments.values())
    assert grad_buffer.untyped_storage().nbytes() == 0 and weights.untyped_storage().nbytes() == 6 * 4
    assert off.offload(list(moments.values()), []) == 0  # already off: nothing happens

    off.reload()
    assert not off.active and off.host_bytes == 0
    assert all(torch.equal(moments[k], before[k]) and id(moments[k]) == ids[k] for k in moments)
    assert torch.equal(grad_buffer, torch.zeros(10)) and torch.equal(grad_view, torch.zeros(5))
    grad_view.add_(1.0)  # the view still writes into the buffer
    assert grad_buffer.sum() == 5.0
    off.reload()  # nothing offloaded: a no-op
