"""The losses give the same numbers on a CUDA device as on the CPU (fp32 maths everywhere)."""

import pytest
import torch

from megatron_sdpo.algorithms.grpo import policy_loss
from megatron_sdpo.algorithms.sdpo import distill_mask, token_distillation_loss


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 7, 37, generator=g).to(dtype)
    t = torch.randn(3, 7, 37, generator=g).to(dtype)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    old = -torch.rand(3, 7, generator=g)
    lp = (old + 0.3 * torch.randn(3, 7, generator=g)).to(dtype)
    adv = torch.randn(3, generator=g)
    ids = torch.randint(0, 4, (3, 7), generator=g)
    results = {}
    for dev in ("cpu", "cuda"):
        a = s.to(dev).clone().requires_grad_(True)
        kl, _ = token_distillation_loss(a, t.to(dev), mask.to(dev), alpha=0.5, topk=5)
        b = lp.to(dev).clone().requires_grad_(True)
        pg, m = policy_loss(b, old.to(dev), adv.to(dev), mask.to(dev), normalizer=mask.sum().to(dev))
        ((kl + pg) * 1.7).backward()
        dm = distill_mask(ids.to(dev), mask.to(dev), reasoning_end_ids=[1, 2], distill_cot=False)
        results[dev] = [x.detach().float().cpu() for x in (kl, pg, a.grad, b.grad, m["grpo/ratio_max"])] + [dm.cpu()]
    for x, y in zip(results["cpu"], results["cuda"], strict=True):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4)
