"""encode_prompt: earlier turns (worked examples) before the user message, with and without a
chat template."""
import copy

import pytest

from megatron_sdpo.chat import encode_prompt, encode_prompts, record_prompts

TURNS = [{"role": "user", "content": "Tom has 2 pens, gets 3. How many?"}, {"role": "assistant", "content": "\\boxed{5}"}]


@pytest.fixture(scope="module")
def tok():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    return load_tokenizer(ensure_tiny_base())


def test_history_goes_through_the_chat_template_before_the_message(tok):
    ids = encode_prompt(tok, "Ann has 4 coins, gets 1. How many?", TURNS)
    want = tok.apply_chat_template(
        [*TURNS, {"role": "user", "content": "Ann has 4 coins, gets 1. How many?"}], add_generation_prompt=True, tokenize=True
    )
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids == [int(i) for i in want]
    text = tok.decode(ids)
    assert text.index("Tom has 2 pens") < text.index("\\boxed{5}") < text.index("Ann has 4 coins")


def test_without_a_chat_template_turns_are_plain_lines(tok):
    raw = copy.copy(tok)
    raw.chat_template = None
    ids = encode_prompt(raw, "Ann?", TURNS)
    assert ids == raw("Tom has 2 pens, gets 3. How many?\n\\boxed{5}\n\nAnn?", add_special_tokens=True)["input_ids"]
    assert encode_prompt(raw, "Ann?") == raw("Ann?", add_special_tokens=True)["input_ids"]


def test_record_prompts_read_each_record_history(tok):
    recs = [{"prompt": "a?", "history": TURNS}, {"prompt": "b?"}]
    assert record_prompts(tok, recs) == [encode_prompt(tok, "a?", TURNS), encode_prompt(tok, "b?")]
    with pytest.raises(ValueError, match="2 messages but 1 histories"):
        encode_prompts(tok, ["a", "b"], [TURNS])
