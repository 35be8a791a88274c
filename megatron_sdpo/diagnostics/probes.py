"""Response drift on probe prompts: generate with two HF checkpoints and compare.

For each probe domain, prompts come from the built-in synthetic suite's "id" split. Both
checkpoints answer greedily (the deterministic "what does the model say") for the embedding
metrics; the new checkpoint B also samples at temperature 1 and both models score those
samples, giving the excess KL(B || A) on B's own distribution. Plain transformers generate:
this is a diagnostic on a handful of prompts, not a rollout engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_sdpo.diagnostics.response_drift import Embedder, MiniLMEmbedder, excess_kl, response_drift
from megatron_sdpo.errors import CheckpointError
from megatron_sdpo.models.hf_model import load_causal_lm


def load_hf_policy(path: str | Path):
    """(model, tokenizer) from an HF checkpoint dir, fp32, eval mode; CheckpointError if the
    directory lacks a loadable model or tokenizer."""
    from transformers import AutoTokenizer

    from megatron_sdpo.models.hf_dir import check_hf_model_dir

    check_hf_model_dir(path, what="checkpoint")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(
            f"response drift needs a tokenizer saved in {path}: {' '.join(str(exc).split())}"
        ) from None
    try:
        model = load_causal_lm(str(path), torch.float32)
    except Exception as exc:
        raise CheckpointError(f"cannot load model from {path}: {' '.join(str(exc).split())}") from None
    return model.eval(), tok


def encode_prompts(tok, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt: the chat template (user turn + generation prompt) when the
    tokenizer has one, else the raw text."""
    out = []
    for p in prompts:
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out.append(list(ids))
        else:
            out.append(tok(p, add_special_tokens=True)["input_ids"])
    return out


@torch.no_grad()
def generate_responses(
    model, prompt_ids: list[list[int]], *, eos_id: int | None, pad_id: int, max_new_tokens: int, sample: bool, seed: int
) -> list[list[int]]:
    """One response per prompt (token ids, cut after the first EOS). Prompts run one at a
    time: no padding subtleties, and probe sets are small."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for ids in prompt_ids:
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        x = torch.tensor([ids])
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_p=1.0 if sample else None,
            top_k=0 if sample else None,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )[0, len(ids) :].tolist()
        if eos_id is not None and eos_id in y:
            y = y[: y.index(eos_id) + 1]
        out.append(y)
    return out


@torch.no_grad()
def response_logprobs(
    model, prompt_ids: list[list[int]], response_ids: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 logprobs [B, T] of each response given its prompt, and the mask [B, T]."""
    T = max((len(r) for r in response_ids), default=0)
    lp = torch.zeros(len(prompt_ids), max(T, 1), dtype=torch.float32)
    mask = torch.zeros_like(lp)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if not r:
            continue
        x = torch.tensor([p + r])
        logits = model(x).logits[0, len(p) - 1 : len(p) + len(r) - 1].float()
        lp[i, : len(r)] = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        mask[i, : len(r)] = 1.0
    return lp, mask


def probe_drift(
    a_dir: str | Path,
    b_dir: str | Path,
    *,
    domains: Sequence[str],
    n: int = 8,
    seed: int = 0,
    max_new_tokens: int = 64,
    embedder: Embedder | None = None,
) -> dict:
    """Response drift of checkpoint B vs A on `n` synthetic "id" prompts per domain.

    Returns {domain: {"n", "cosine_mean", "cosine_min", "mmd2", "mmd", "bandwidth",
    "kl_k1", "kl_k3", "kl_tokens"}, "all": same over every probe}.
    """
    from megatron_sdpo.data.synthetic import generate

    model_a, tok = load_hf_policy(a_dir)
    model_b, _ = load_hf_policy(b_dir)
    embedder = embedder or MiniLMEmbedder()
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    result: dict = {}
    texts_a_all: list[str] = []
    texts_b_all: list[str] = []
    kl_parts = []
    for d_i, domain in enumerate(domains):
        prompts = [r["prompt"] for r in generate(domain, "id", n, seed)]
        ids = encode_prompts(tok, prompts)
        kw = dict(eos_id=eos, pad_id=pad, max_new_tokens=max_new_tokens)
        greedy_a = generate_responses(model_a, ids, sample=False, seed=seed, **kw)
        greedy_b = generate_responses(model_b, ids, sample=False, seed=seed, **kw)
        texts_a = tok.batch_decode(greedy_a, skip_special_tokens=True)
        texts_b = tok.batch_decode(greedy_b, skip_special_tokens=True)
        stats = response_drift(texts_a, texts_b, embedder)
        samples = generate_responses(model_b, ids, sample=True, seed=seed + 1000 * (d_i + 1), **kw)
        lp_b, mask = response_logprobs(model_b, ids, samples)
        lp_a, _ = response_logprobs(model_a, ids, samples)
        kl = excess_kl(lp_b, lp_a, mask)
        kl_parts.append((lp_b, lp_a, mask))
        stats.update({"kl_k1": float(kl["kl_k1"]), "kl_k3": float(kl["kl_k3"]), "kl_tokens": float(kl["tokens"])})
        result[domain] = stats
        texts_a_all += texts_a
        texts_b_all += texts_b
    if len(domains) > 1:
        overall = response_drift(texts_a_all, texts_b_all, embedder)
        width = max(p[0].shape[1] for p in kl_parts)
        pad_to = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))
        kl = excess_kl(*(torch.cat([pad_to(p[j]) for p in kl_parts]) for j in range(3)))
        overall.update({"kl_k1": float(kl["kl_k1"]), "kl_k3": float(kl["kl_k3"]), "kl_tokens": float(kl["tokens"])})
        result["all"] = overall
    return result
