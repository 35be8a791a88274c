"""Artifact rates at token level, and how much a scorer (the teacher, the base) endorses them.

artifacts.py counts artifacts per response (a second `\\boxed` anywhere makes the response
"repeated"); the amplification the paper describes is per token: self-distillation raises the
log-probability of the tokens that make an artifact. Here each response token is marked

  format repeat   the token overlaps an occurrence of a format string (`\\boxed`, ...) after
                  the string's first occurrence in the same response: the first `\\boxed` is
                  the answer's format, every later one is the artifact;
  n-gram repeat   the token belongs to a token n-gram that already occurred earlier in the same
                  response (the first occurrence is not marked, each later copy is);

and the endorsement of marked tokens by a scorer is its mean log-probability (and probability)
on marked tokens against its mean on the other response tokens of the same responses.

Inputs are per-token text pieces (each token id decoded alone) for format strings, which may
span several tokens and tokenize differently in context, and token ids for n-grams.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_sdpo.diagnostics.artifacts import DEFAULT_FORMAT_TOKENS, format_token_key
from megatron_sdpo.errors import DataError


def format_repeat_mask(pieces: Sequence[str], token: str) -> list[bool]:
    """Per token of one response (its text `pieces`): True where the token overlaps a
    non-first occurrence of `token` in the concatenated text. Occurrences do not overlap
    each other (str.find from the end of the previous one)."""
    if not token:
        raise ValueError("format_repeat_mask needs a non-empty format string")
    text = "".join(pieces)
    spans = []
    at = text.find(token)
    while at >= 0:
        spans.append((at, at + len(token)))
        at = text.find(token, at + len(token))
    out = [False] * len(pieces)
    start = 0
    for i, piece in enumerate(pieces):
        end = start + len(piece)
        # half-open overlap; an empty piece (a special token decoded to "") overlaps nothing
        out[i] = any(s < end and start < e for s, e in spans[1:]) if end > start else False
        start = end
    return out


def repeated_ngram_mask(ids: Sequence[int], n: int) -> list[bool]:
    """Per token of one response (its ids): True where the token lies in an n-gram equal to an
    earlier-starting n-gram of the same response. All False with fewer than n tokens."""
    if n < 1:
        raise ValueError(f"n-gram length must be >= 1, got {n}")
    out = [False] * len(ids)
    seen: set[tuple[int, ...]] = set()
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        if gram in seen:
            for j in range(i, i + n):
                out[j] = True
        else:
            seen.add(gram)
    return out


def token_artifact_masks(
    pieces: Sequence[Sequence[str]],
    ids: Sequence[Sequence[int]],
    *,
    format_tokens: Sequence[str] = DEFAULT_FORMAT_TOKENS,
    ngram: int = 4,
) -> dict[str, list[list[bool]]]:
    """{"fmt_<key>": mask per format string, "format_any", "ngram", "any"}: per response, per
    token. pieces[i] and ids[i] describe the same response and must have equal lengths."""
    if len(pieces) != len(ids):
        raise DataError(f"token artifacts: {len(pieces)} piece lists for {len(ids)} responses")
    for i, (p, t) in enumerate(zip(pieces, ids, strict=True)):
        if len(p) != len(t):
            raise DataError(f"token artifacts: response {i} has {len(p)} pieces for {len(t)} token ids")
    out: dict[str, list[list[bool]]] = {}
    for tok in format_tokens:
        out[f"fmt_{format_token_key(tok)}"] = [format_repeat_mask(p, tok) for p in pieces]
    fmt_keys = list(out)
    out["format_any"] = [
        [any(out[k][i][j] for k in fmt_keys) for j in range(len(pieces[i]))] for i in range(len(pieces))
    ]
    out["ngram"] = [repeated_ngram_mask(t, ngram) for t in ids]
    out["any"] = [
        [f or g for f, g in zip(fa, ng, strict=True)] for fa, ng in zip(out["format_any"], out["ngram"], strict=True)
    ]
    return out


def token_artifact_rates(
    pieces: Sequence[Sequence[str]],
    ids: Sequence[Sequence[int]],
    *,
    format_tokens: Sequence[str] = DEFAULT_FORMAT_TOKENS,
    ngram: int = 4,
) -> dict[str, float]:
    """Shares of all response tokens marked by each mask of `token_artifact_masks`:
    {"tokens", "<mask>_token_rate" ...}; rates are NaN when there are no tokens."""
    masks = token_artifact_masks(pieces, ids, format_tokens=format_tokens, ngram=ngram)
    total = sum(len(t) for t in ids)
    out: dict[str, float] = {"tokens": float(total)}
    for key, mask in masks.items():
        marked = sum(sum(m) for m in mask)
        out[f"{key}_token_rate"] = marked / total if total else math.nan
    return out


def mask_tensor(mask: Sequence[Sequence[bool]], shape: tuple[int, int]) -> torch.Tensor:
    """Left-aligned [B, T] float32 tensor of per-response token masks (padding 0), the layout
    of SequenceBatch.response_mask; DataError when a response is longer than T."""
    b, t = shape
    if len(mask) != b:
        raise DataError(f"token mask has {len(mask)} responses for a batch of {b}")
    out = torch.zeros(b, t, dtype=torch.float32)
    for i, row in enumerate(mask):
        if len(row) > t:
            raise DataError(f"token mask of response {i} has {len(row)} tokens, the batch {t}")
        out[i, : len(row)] = torch.tensor([float(x) for x in row], dtype=torch.float32)
    return out


def artifact_endorsement(logprobs: torch.Tensor, artifact: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How much a scorer endorses artifact tokens: its mean log-prob (and prob) on response
    tokens marked `artifact` against its means on the other response tokens.

    logprobs, artifact, mask: [B, T] (artifact and mask 0/1; artifact counts only where mask is
    1). Means over tokens pooled across the batch, fp64 accumulation. Returns {"artifact_tokens",
    "other_tokens", "artifact_logprob", "other_logprob", "logprob_gap" (artifact - other; > 0:
    the scorer finds artifact tokens the likelier), "artifact_prob", "other_prob"}; a mean over
    no tokens is NaN.
    """
    if logprobs.shape != artifact.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"artifact_endorsement needs equal [B, T] shapes, got {tuple(logprobs.shape)}, "
            f"{tuple(artifact.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(torch.float64) > 0
    art = m & (artifact.to(torch.float64) > 0)
    other = m & ~art
    lp = logprobs.to(torch.float64)

    def mean(values: torch.Tensor, where: torch.Tensor) -> float:
        n = int(where.sum())
        # where, not multiply: padding may hold -inf log-probs
        return float(torch.where(where, values, 0.0).sum() / n) if n else math.nan

    out = {
        "artifact_tokens": float(art.sum()),
        "other_tokens": float(other.sum()),
        "artifact_logprob": mean(lp, art),
        "other_logprob": mean(lp, other),
        "artifact_prob": mean(lp.exp(), art),
        "other_prob": mean(lp.exp(), other),
    }
    out["logprob_gap"] = out["artifact_logprob"] - out["other_logprob"]
    return out
