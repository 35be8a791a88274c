"""Turning a user message (after any earlier turns) into prompt token ids with the model's chat
template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Turns = Sequence[Mapping[str, str]]

# The run's chat-template keyword arguments (`model.chat_template_kwargs`) travel with its
# tokenizer: every prompt encoder (rollout, teacher re-prompt, evaluation, drift probes through
# `encode_prompt`) receives the tokenizer, so none can render a prompt without them.
_KWARGS_ATTR = "_megatron_sdpo_chat_template_kwargs"


def set_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any]) -> Any:
    """Attach `kwargs` (e.g. {"enable_thinking": False}) to `tokenizer`: `encode_prompt` passes
    them to its chat template from now on. Returns the tokenizer."""
    setattr(tokenizer, _KWARGS_ATTR, dict(kwargs))
    return tokenizer


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """The chat-template keyword arguments attached to `tokenizer` ({} when none)."""
    return dict(getattr(tokenizer, _KWARGS_ATTR, None) or {})


def encode_prompt(tokenizer: Any, message: str, history: Turns = ()) -> list[int]:
    """Token ids of `history` (earlier {"role", "content"} turns, e.g. worked examples) and then
    `message` as a user turn, followed by the assistant generation prompt.

    Models without a chat template get the raw text, each earlier turn on its own line and a
    blank line after each reply, so every HF tokenizer works (base models).
    """
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [*history, {"role": "user", "content": message}],
            add_generation_prompt=True,
            tokenize=True,
            **template_kwargs(tokenizer),
        )
        # transformers 5 returns a BatchEncoding; 4.x returns a list of ids.
        ids = out["input_ids"] if hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]
    text = "".join(t["content"] + ("\n\n" if t["role"] == "assistant" else "\n") for t in history)
    return [int(i) for i in tokenizer(text + message, add_special_tokens=True)["input_ids"]]


def encode_prompts(
    tokenizer: Any, messages: Sequence[str], histories: Sequence[Turns] | None = None
) -> list[list[int]]:
    """`encode_prompt` over `messages`; `histories[i]` (None: none) precedes `messages[i]`.
    Each distinct (history, message) is rendered once: a batch repeats them (SDPO's teacher
    prompts, where the failed samples of a group are re-prompted with the same sibling)."""
    if histories is None:
        histories = [()] * len(messages)
    elif len(histories) != len(messages):
        raise ValueError(f"{len(messages)} messages but {len(histories)} histories")
    done: dict[tuple, list[int]] = {}
    out = []
    for m, h in zip(messages, histories, strict=True):
        turns = h or ()
        key = (m, tuple(tuple(sorted(t.items())) for t in turns))
        if key not in done:
            done[key] = encode_prompt(tokenizer, m, turns)
        out.append(list(done[key]))  # a list per prompt: callers may change theirs
    return out


def record_prompts(tokenizer: Any, records: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Prompt token ids of `records`: each record's "history" turns (if any), then its "prompt"."""
    return encode_prompts(tokenizer, [r["prompt"] for r in records], [r.get("history", ()) for r in records])
