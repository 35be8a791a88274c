"""Turning a user message into prompt token ids with the model's chat template."""
from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, message: str) -> list[int]:
    """Token ids of `message` as one user turn, followed by the assistant generation prompt.

    Models without a chat template get the raw message (base models), so every HF tokenizer works.
    """
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding; 4.x returns a list of ids.
        ids = out["input_ids"] if hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(message, add_special_tokens=True)["input_ids"]]


def encode_prompts(tokenizer: Any, messages: list[str]) -> list[list[int]]:
    return [encode_prompt(tokenizer, m) for m in messages]
