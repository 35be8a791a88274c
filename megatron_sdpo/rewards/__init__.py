"""Verifiers: one score in [0, 1] and one feedback string per (domain, response, record).

``score`` never raises because of what the model wrote (malformed, huge or binary responses
score 0 with feedback); it raises for a bad record (DataError), an unknown domain (ValueError)
or a broken sandbox (SandboxError), which are the caller's problems, not the model's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar, cast

from megatron_sdpo.errors import UserError
from megatron_sdpo.interfaces.domains import DOMAINS
from megatron_sdpo.rewards.result import RewardResult
from megatron_sdpo.rewards.sandbox import SandboxError

__all__ = ["RewardResult", "score", "score_batch"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")


def _scorer(domain: str) -> Callable[[str, dict], RewardResult]:
    # Imported lazily: the code sandbox and math-verify are not needed to score the other domains.
    if domain == "math":
        from megatron_sdpo.rewards.math import score_math

        return score_math
    if domain == "science":
        from megatron_sdpo.rewards.mcq import score_mcq

        return score_mcq
    if domain == "tooluse":
        from megatron_sdpo.rewards.tooluse import score_tooluse

        return score_tooluse
    if domain == "code":
        from megatron_sdpo.rewards.code import score_code

        return score_code
    raise ValueError(f"unknown reward domain {domain!r}; known domains: {', '.join(DOMAINS)}")


def _guarded(domain: str, fn: Callable[[], Sequence[_R]], n: int) -> list[_R | RewardResult]:
    try:
        return list(fn())
    except (UserError, SandboxError):
        raise
    except Exception as exc:  # a verifier bug triggered by a response: log it, score 0
        log.exception("%s verifier failed on a response", domain)
        return [
            RewardResult(
                0.0, "The response could not be checked.", {"error": "verifier_exception", "exception": repr(exc)[:200]}
            )
            for _ in range(n)
        ]


def _as_text(response: object) -> str:
    if isinstance(response, bytes):
        return response.decode("utf-8", errors="replace")
    return response if isinstance(response, str) else str(response)


def score(domain: str, response: str, record: dict) -> RewardResult:
    """Score one `response` (the model's text) to `record` (see the data conventions)."""
    fn = _scorer(domain)
    text = _as_text(response)
    return _guarded(domain, lambda: [fn(text, record)], 1)[0]


def score_batch(
    domain: str, responses: list[str], records: list[dict], *, batched_code: bool = False
) -> list[RewardResult]:
    """Score responses[i] against records[i]. Math sends the batch's answers to the math-verify
    worker in one request; code batches share sandbox work when `batched_code` (one pre-warmed
    sandbox forks per test case for the whole batch)."""
    if len(responses) != len(records):
        raise ValueError(f"{len(responses)} responses but {len(records)} records")
    texts = [_as_text(r) for r in responses]
    if domain == "code":
        from megatron_sdpo.rewards.code import score_code_batch

        return _results(_guarded(domain, lambda: score_code_batch(texts, records, batched=batched_code), len(texts)))
    if domain == "math":
        # Every boxed answer of the batch goes to the math-verify worker in one request.
        from megatron_sdpo.rewards.math import check_math_batch, prepare_math

        prepared = [_guarded_one(domain, partial(prepare_math, t, r)) for t, r in zip(texts, records, strict=True)]
        return _results(_guarded(domain, lambda: check_math_batch(prepared), len(prepared)))
    fn = _scorer(domain)
    return _results([_guarded_one(domain, partial(fn, t, r)) for t, r in zip(texts, records, strict=True)])


def _guarded_one(domain: str, fn: Callable[[], _R]) -> _R | RewardResult:
    return _guarded(domain, lambda: [fn()], 1)[0]


def _results(items: Sequence[object]) -> list[RewardResult]:
    """The scores of a batch: every item a RewardResult once the verifier has run."""
    return cast(list[RewardResult], list(items))
