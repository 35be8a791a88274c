"""encode_prompt: earlier turns (worked examples) before the user message, with and without a
chat template."""

import copy

import pytest

from megatron_sdpo.chat import encode_prompt, encode_prompts, record_prompts

TURNS = [
    {"role": "user", "content": "Tom has 2 pens, gets 3. How many?"},
    {"role": "assistant", "content": "\\boxed{5}"},
]


@pytest.fixture(scope="module")
def tok():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    return load_tokenizer(ensure_tiny_base())


def test_history_goes_through_the_chat_template_before_the_message(tok):
    ids = encode_prompt(tok, "Ann has 4 coins, gets 1. How many?", TURNS)
    want = tok.apply_chat_template(
        [*TURNS, {"role": "user", "content": "Ann has 4 coins, gets 1. How many?"}],
        add_generation_prompt=True,
        tokenize=True,
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


def test_repeated_prompts_are_rendered_once_and_returned_as_separate_lists(tok, monkeypatch):
    import megatron_sdpo.chat as chat

    calls = []
    real = chat.encode_prompt
    monkeypatch.setattr(chat, "encode_prompt", lambda t, m, h=(): (calls.append((m, len(h))), real(t, m, h))[1])
    other = [TURNS[0], {"role": "assistant", "content": "\\boxed{6}"}]
    msgs, hists = ["a?", "a?", "a?", "b?", "a?"], [TURNS, TURNS, other, TURNS, None]
    got = encode_prompts(tok, msgs, hists)
    assert got == [real(tok, m, h or ()) for m, h in zip(msgs, hists, strict=True)]
    assert calls == [("a?", 2), ("a?", 2), ("b?", 2), ("a?", 0)]  # the history is part of the key
    got[0].append(-1)
    assert got[1][-1] != -1


# The generation-prompt part of Qwen3's chat template: with enable_thinking false it closes an
# empty reasoning block, so the model answers without thinking.
QWEN3_STYLE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _qwen3_style(tok):
    q = copy.copy(tok)
    q.chat_template = QWEN3_STYLE
    return q


def test_template_kwargs_reach_the_chat_template(tok):
    from megatron_sdpo.chat import set_template_kwargs, template_kwargs

    q = _qwen3_style(tok)
    msgs = [*TURNS, {"role": "user", "content": "Ann?"}]
    thinking = q.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    plain = q.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n") and plain == thinking + "<think>\n\n</think>\n\n"
    assert encode_prompt(q, "Ann?", TURNS) == q(thinking, add_special_tokens=False)["input_ids"]
    assert template_kwargs(q) == {}
    set_template_kwargs(q, {"enable_thinking": False})
    want = q(plain, add_special_tokens=False)["input_ids"]
    assert encode_prompt(q, "Ann?", TURNS) == want
    assert record_prompts(q, [{"prompt": "Ann?", "history": TURNS}]) == [want]
    assert encode_prompts(q, ["Ann?"], [TURNS]) == [want]


@pytest.mark.parametrize(
    "preset", ["qwen3_4b", "qwen3_4b_frozen", "qwen3_4b_stable", "qwen3_4b_grpo", "olmo3_7b_frozen"]
)
def test_paper_presets_render_prompts_without_thinking(tok, preset):
    """The reference's `apply_chat_template_kwargs: {enable_thinking: false}`: every prompt the
    run renders (rollout, teacher re-prompt, evaluation all go through encode_prompt) ends in the
    closed empty reasoning block."""
    from megatron_sdpo.chat import set_template_kwargs
    from megatron_sdpo.config import load_config

    cfg = load_config(preset)
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}
    q = set_template_kwargs(_qwen3_style(tok), cfg.model.chat_template_kwargs)
    ids = encode_prompt(q, "What is 2 + 3?")
    assert q.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The tiny presets keep the template's defaults.
    assert load_config("tiny_sdpo").model.chat_template_kwargs == {}
