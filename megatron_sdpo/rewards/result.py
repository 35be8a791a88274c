"""The value every verifier returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardResult:
    """Outcome of scoring one response.

    score: in [0, 1] (1 = correct). feedback: text for the model (the SDPO teacher context);
    it must never reveal a hidden gold answer unless the verifier was asked to.
    details: machine-readable extras (parsed answer, pass fraction, error kind) for logging.
    """

    score: float
    feedback: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.score <= 1.0:
            raise ValueError(f"score must lie in [0, 1], got {self.score}")


def clip_text(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a marker, so feedback stays short."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."
