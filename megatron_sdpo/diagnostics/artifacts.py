"""Artifact statistics of a batch of responses and a collapse monitor.

The SDPO collapse mode the paper reports is a formatting artifact (e.g. a second `\\boxed`)
that the teacher-student loop amplifies until every answer is degenerate. These statistics
are cheap (string work only) so they run every step and every eval.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_sdpo.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DEFAULT_FORMAT_TOKENS: tuple[str, ...] = ("\\boxed", "</answer>", "Action:")


@dataclass
class ArtifactConfig:
    """What counts as an artifact.

    format_tokens: substrings counted per response; "repeated" means more than once in one
        response (a well-formed answer has exactly one `\\boxed`, one `</answer>`; tool use
        may legitimately repeat `Action:`, so read its rate against the base).
    ngram: n of the word n-grams whose repetition within a response is measured.
    """

    format_tokens: tuple[str, ...] = DEFAULT_FORMAT_TOKENS
    ngram: int = 4

    def __post_init__(self) -> None:
        if self.ngram < 1:
            raise ConfigError(f"artifacts.ngram must be >= 1, got {self.ngram}")
        if any(not t for t in self.format_tokens):
            raise ConfigError("artifacts.format_tokens must not contain an empty string")


def repeated_ngram_rate(text: str, n: int) -> float | None:
    """Share of the word n-grams of `text` that repeat an earlier n-gram of the same text:
    (count - distinct) / count. None when the text has fewer than n words."""
    words = text.split()
    if len(words) < n:
        return None
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams)


# Format tokens a well-formed answer holds once: an occurrence after the first is an artifact.
ONCE_TOKENS: tuple[str, ...] = ("\\boxed", "</answer>")


def format_token_key(token: str) -> str:
    """Metric-name-safe form of a format token: `\\boxed` -> boxed, `</answer>` -> answer_close."""
    key = token.strip()
    if key.startswith("</"):
        key = key[2:].rstrip(">") + "_close"
    key = "".join(ch if ch.isalnum() else "_" for ch in key.lstrip("\\<").rstrip(":>")).strip("_")
    return key.lower() or "token"


def artifact_stats(
    responses: Sequence[str],
    *,
    truncated: Sequence[bool] | None = None,
    token_lengths: Sequence[int] | None = None,
    teacher_mask: Sequence[bool] | None = None,
    config: ArtifactConfig | None = None,
) -> dict[str, float]:
    """Per-batch (or per-eval) artifact statistics of N response strings.

    truncated [N]: stopped at max length (from the rollout engine); token_lengths [N]:
    response lengths in tokens; teacher_mask [N]: the sample had a teacher context. Each is
    optional; its metrics are omitted when not given. config: ArtifactConfig() when None.

    Keys (all floats): n, repeated_ngram_rate (mean over responses with >= ngram words; NaN if
    none), repeated_ngram_any (share of responses with any repeated n-gram), empty_rate
    (whitespace-only responses), truncated_rate, mean_chars, mean_tokens, teacher_share, and for
    each format token `tok`: fmt_<key>_mean_count, fmt_<key>_repeat_rate (share of responses
    with more than one occurrence), fmt_<key>_present_rate.
    """
    n = len(responses)
    if n == 0:
        raise DataError("artifact_stats needs at least one response")
    for name, seq in (("truncated", truncated), ("token_lengths", token_lengths), ("teacher_mask", teacher_mask)):
        if seq is not None and len(seq) != n:
            raise DataError(f"artifact_stats: {name} has {len(seq)} entries for {n} responses")
    config = ArtifactConfig() if config is None else config
    rates = [repeated_ngram_rate(r, config.ngram) for r in responses]
    measured = [r for r in rates if r is not None]
    out: dict[str, float] = {
        "n": float(n),
        "repeated_ngram_rate": sum(measured) / len(measured) if measured else math.nan,
        "repeated_ngram_any": sum(1 for r in measured if r > 0) / n,
        "empty_rate": sum(1 for r in responses if not r.strip()) / n,
        "mean_chars": sum(len(r) for r in responses) / n,
    }
    for tok in config.format_tokens:
        counts = [r.count(tok) for r in responses]
        key = format_token_key(tok)
        out[f"fmt_{key}_mean_count"] = sum(counts) / n
        out[f"fmt_{key}_repeat_rate"] = sum(1 for c in counts if c > 1) / n
        out[f"fmt_{key}_present_rate"] = sum(1 for c in counts if c > 0) / n
    if truncated is not None:
        out["truncated_rate"] = sum(1 for t in truncated if t) / n
    if token_lengths is not None:
        out["mean_tokens"] = sum(token_lengths) / n
    if teacher_mask is not None:
        out["teacher_share"] = sum(1 for t in teacher_mask if t) / n
    return out


@dataclass
class CollapseConfig:
    """Alarm thresholds (None disables a check); an alarm fires when any enabled check trips.

    max_repeated_ngram_rate / max_format_repeat_rate / max_empty_rate / max_truncated_rate:
        upper bounds on the artifact_stats of the same names (format repeat: any format token).
    min_mean_chars: lower bound on mean response length (answers shrinking to nothing).
    min_length_ratio: lower bound on the mean response length (tokens where known, else chars)
        relative to its mean over the monitor's first `length_reference_updates` updates (the
        stage's start): answers shrinking to fragments, which no absolute bound fits every domain.
    min_reward_ratio: lower bound on the mean training reward of the last
        `length_reference_updates` updates relative to its mean over the first ones (the stage's
        start), when it has also fallen by at least `min_reward_drop`: a collapse that keeps the
        answers' form and loses their content (the old-defaults control's code stage: rewards
        0.37-0.43 -> 0.05-0.21 with no repeat and no shortening). The absolute floor keeps a stage
        that starts near 0 from alarming on noise.
    patience: consecutive alarming updates before `should_stop` turns true.
    stop: whether an alarm may stop the stage (otherwise it only logs and marks the run).
    """

    max_repeated_ngram_rate: float | None = 0.5
    max_format_repeat_rate: float | None = 0.5
    max_empty_rate: float | None = 0.5
    max_truncated_rate: float | None = None
    min_mean_chars: float | None = None
    min_length_ratio: float | None = 0.6
    length_reference_updates: int = 3
    min_reward_ratio: float | None = 0.5
    min_reward_drop: float = 0.1
    patience: int = 3
    stop: bool = False

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ConfigError(f"collapse.patience must be >= 1, got {self.patience}")
        if self.length_reference_updates < 1:
            raise ConfigError(f"collapse.length_reference_updates must be >= 1, got {self.length_reference_updates}")
        if self.min_length_ratio is not None and not 0.0 < self.min_length_ratio <= 1.0:
            raise ConfigError(f"collapse.min_length_ratio must be in (0, 1], got {self.min_length_ratio}")
        if self.min_reward_ratio is not None and not 0.0 < self.min_reward_ratio <= 1.0:
            raise ConfigError(f"collapse.min_reward_ratio must be in (0, 1], got {self.min_reward_ratio}")
        if self.min_reward_drop < 0:
            raise ConfigError(f"collapse.min_reward_drop must be >= 0, got {self.min_reward_drop}")
        for name in ("max_repeated_ngram_rate", "max_format_repeat_rate", "max_empty_rate", "max_truncated_rate"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ConfigError(f"collapse.{name} must be a rate in [0, 1], got {v}")


@dataclass
class Alarm:
    """Result of one `CollapseMonitor.update`: truthy when the alarm fired."""

    fired: bool
    reasons: list[str] = field(default_factory=list)
    step: int | None = None

    def __bool__(self) -> bool:
        return self.fired


class CollapseMonitor:
    """Watch artifact statistics step by step; alarm, log, mark the run, and optionally stop.

    On every firing update the reason is logged at WARNING and appended to `events`; when
    `marker_path` is given the events are (re)written there as JSON, so a finished run
    carries a visible mark; events already in the marker under another `label` (earlier stages
    of the run) are kept. `should_stop` is true once `patience` consecutive updates fired and
    the config allows stopping.
    """

    def __init__(self, config: CollapseConfig | None = None, *, marker_path: str | Path | None = None, label: str = ""):
        # A fresh default each: the config is a mutable dataclass kept on the monitor.
        self.config = CollapseConfig() if config is None else config
        self.marker_path = Path(marker_path) if marker_path is not None else None
        self.label = label
        self.events: list[dict] = []
        self.consecutive = 0
        self.updates = 0
        self.lengths: list[float] = []  # the first length_reference_updates mean lengths
        self.rewards: list[float] = []  # the stage's mean training reward per update
        self._others: list[dict] = []
        if self.marker_path is not None and self.marker_path.is_file():
            try:
                old = json.loads(self.marker_path.read_text())["events"]
            except (OSError, ValueError, KeyError, TypeError):
                old = []  # an unreadable marker is rewritten, not fatal
            self._others = [e for e in old if isinstance(e, dict) and e.get("label") != label]

    def _reward_check(self, reward: float | None) -> list[str]:
        c = self.config
        if c.min_reward_ratio is None or reward is None or not math.isfinite(reward):
            return []
        self.rewards.append(float(reward))
        w = c.length_reference_updates
        if len(self.rewards) < 2 * w:  # the two windows must not overlap
            return []
        ref, cur = math.fsum(self.rewards[:w]) / w, math.fsum(self.rewards[-w:]) / w
        if cur < c.min_reward_ratio * ref and ref - cur >= c.min_reward_drop:
            return [f"reward={cur:.3f} (last {w} steps) < {c.min_reward_ratio:.2f} x stage start {ref:.3f}"]
        return []

    def _checks(self, stats: dict[str, float]) -> list[str]:
        c = self.config
        reasons = []

        def above(key: str, limit: float | None, value: float | None = None) -> None:
            v = stats.get(key) if value is None else value
            if limit is not None and v is not None and not math.isnan(v) and v > limit:
                reasons.append(f"{key}={v:.3f} > {limit:.3f}")

        above("repeated_ngram_rate", c.max_repeated_ngram_rate)
        above("empty_rate", c.max_empty_rate)
        above("truncated_rate", c.max_truncated_rate)
        if c.max_format_repeat_rate is not None:
            for key, v in sorted(stats.items()):
                if key.startswith("fmt_") and key.endswith("_repeat_rate"):
                    above(key, c.max_format_repeat_rate, v)
        if c.min_mean_chars is not None and stats.get("mean_chars", math.inf) < c.min_mean_chars:
            reasons.append(f"mean_chars={stats['mean_chars']:.1f} < {c.min_mean_chars:.1f}")
        key = "mean_tokens" if "mean_tokens" in stats else "mean_chars"
        length = stats.get(key)
        if c.min_length_ratio is not None and length is not None:
            if len(self.lengths) < c.length_reference_updates:
                self.lengths.append(float(length))
            else:
                ref = sum(self.lengths) / len(self.lengths)
                if length < c.min_length_ratio * ref:
                    reasons.append(f"{key}={length:.1f} < {c.min_length_ratio:.2f} x stage start {ref:.1f}")
        return reasons

    def update(self, stats: dict[str, float], *, step: int | None = None, reward: float | None = None) -> Alarm:
        """Check one artifact_stats dict and the step's mean training reward (None: not
        checked); returns an `Alarm` (truthy when it fired)."""
        self.updates += 1
        reasons = self._checks(stats) + self._reward_check(reward)
        if not reasons:
            self.consecutive = 0
            return Alarm(False, [], step)
        self.consecutive += 1
        event = {
            "label": self.label,
            "step": step,
            "update": self.updates,
            "reasons": reasons,
            "consecutive": self.consecutive,
        }
        self.events.append(event)
        log.warning("collapse alarm%s: %s", f" at step {step}" if step is not None else "", "; ".join(reasons))
        if self.marker_path is not None:
            self.marker_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.marker_path.with_suffix(self.marker_path.suffix + ".tmp")
            events = self._others + self.events
            tmp.write_text(json.dumps({"config": asdict(self.config), "events": events}, indent=2))
            tmp.replace(self.marker_path)
        return Alarm(True, reasons, step)

    @property
    def alarmed(self) -> bool:
        """Whether any update has fired."""
        return bool(self.events)

    @property
    def should_stop(self) -> bool:
        """True when stopping is enabled and the last `patience` updates all fired."""
        return self.config.stop and self.consecutive >= self.config.patience

    def state_dict(self) -> dict:
        """For checkpoints: the counters and events (the config comes from the run config)."""
        return {
            "events": list(self.events),
            "consecutive": self.consecutive,
            "updates": self.updates,
            "lengths": list(self.lengths),
            "rewards": list(self.rewards),
        }

    def load_state_dict(self, state: dict) -> None:
        self.events = list(state["events"])
        self.consecutive = int(state["consecutive"])
        self.updates = int(state["updates"])
        self.lengths = [float(x) for x in state.get("lengths", [])]
        self.rewards = [float(x) for x in state.get("rewards", [])]
