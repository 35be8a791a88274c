"""Teacher re-prompt: message format, sibling choice, feedback, thinking and truncation."""

import random

import pytest
import torch

from megatron_sdpo.algorithms.context import (
    ContextTemplates,
    build_teacher_contexts,
    build_teacher_message,
    context_mask,
    strip_thinking,
)
from megatron_sdpo.errors import ConfigError

P = "What is 2+3? Put the answer in \\boxed{}."


def test_default_message_is_exactly_the_team_format():
    msg = build_teacher_message(P, "It is \\boxed{5}.", "Wrong answer: got 6.")
    assert msg == (
        P + "\n\n"
        "Here is a correct solution:\nIt is \\boxed{5}.\n\n"
        "Feedback on an earlier attempt:\nWrong answer: got 6.\n\n"
        "Now answer the question correctly."
    )
    assert build_teacher_message(P, None, None) == P + "\n\nNow answer the question correctly."
    assert (
        build_teacher_message(P, "", "fb")
        == P + "\n\nFeedback on an earlier attempt:\nfb\n\nNow answer the question correctly."
    )


def test_strip_thinking_variants():
    assert strip_thinking("<think>a\nb</think>\n\\boxed{1}") == "\\boxed{1}"
    assert strip_thinking("x <think>1</think> y <think>2</think> z") == "x  y  z"
    assert strip_thinking("answer first <think>never closed") == "answer first"
    # the opening tag sat in the prompt (Qwen3 template): only the closing one is in the response
    assert strip_thinking("reasoning here</think>\n\nfinal") == "final"
    assert strip_thinking("no tags") == "no tags"


def _contexts(rewards, feedbacks=None, **kw):
    n = len(rewards)
    responses = [f"<think>r{i}</think>resp{i}" for i in range(n)]
    feedbacks = feedbacks if feedbacks is not None else [""] * n
    kw.setdefault("group_size", 4)
    return build_teacher_contexts([P] * n, responses, rewards, feedbacks, **kw)


def test_sibling_is_never_the_sample_itself_and_thinking_is_stripped():
    ctx = _contexts([1.0, 0.0, 1.0, 0.0])
    assert "resp2" in ctx[0] and "resp0" not in ctx[0]  # 0's only other success is 2
    assert "resp0" in ctx[2] and "resp2" not in ctx[2]
    assert all("<think>" not in c and "r0</think>" not in c for c in ctx)
    assert ctx[1] == build_teacher_message(P, "resp0", None)  # first success by default (rng=None)


def test_only_self_success_gets_no_solution():
    both = ContextTemplates(feedback_only_without_solution=False)
    ctx = _contexts([1.0, 0.0, 0.0, 0.0], feedbacks=["ok", "bad 1", "", "bad 3"], templates=both)
    assert ctx[0] is None  # its own success is no signal and successes get no feedback block
    assert ctx[1] == build_teacher_message(P, "resp0", "bad 1")
    assert ctx[2] == build_teacher_message(P, "resp0", None)
    assert ctx[3] == build_teacher_message(P, "resp0", "bad 3")
    torch.testing.assert_close(context_mask(ctx), torch.tensor([0.0, 1.0, 1.0, 1.0]))


def test_feedback_only_without_solution_is_the_default():
    # The reference's policy: a failed sample with a successful sibling sees the sibling only;
    # feedback is the signal of last resort.
    ctx = _contexts([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], feedbacks=["ok", "bad 1", "", "bad 3", "e4", "", "", ""])
    assert ctx[1] == build_teacher_message(P, "resp0", None)
    assert ctx[3] == build_teacher_message(P, "resp0", None)
    assert ctx[4] == build_teacher_message(P, None, "e4")
    assert ctx[5:] == [None, None, None]


def test_templates_for_a_domain_and_the_token_cap():
    from megatron_sdpo.algorithms.context import templates_for, truncate_context_ids
    from megatron_sdpo.config.schema import ContextConfig

    cfg = ContextConfig()  # the reference's policy: feedback in code only
    assert templates_for(cfg, "code").use_feedback and not templates_for(cfg, "math").use_feedback
    assert not templates_for(ContextConfig(use_feedback=False), "code").use_feedback
    everywhere = ContextConfig(feedback_domains=["math", "science", "tooluse", "code"])
    assert all(templates_for(everywhere, d).use_feedback for d in ("math", "science", "tooluse"))
    t = templates_for(cfg, "tooluse")
    assert t.max_solution_chars is None and t.feedback_only_without_solution
    fb = ["", "bad", "", "", "e4", "", "", ""]
    ctx = _contexts([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], feedbacks=fb, templates=t)
    assert ctx[4:] == [None] * 4  # no feedback outside code
    ids = list(range(20))
    assert truncate_context_ids(ids, 8) == list(range(12, 20))  # the end is kept
    assert truncate_context_ids(ids, 20) == ids and truncate_context_ids(ids, None) == ids


def test_all_failed_uses_feedback_or_none_and_groups_do_not_mix():
    ctx = _contexts([0.0, 0.2, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], feedbacks=["e0", None, "", "e3", "", "", "", ""])
    assert ctx[:4] == [build_teacher_message(P, None, "e0"), None, None, build_teacher_message(P, None, "e3")]
    assert "resp5" in ctx[4] and "resp4" in ctx[5]
    assert all(("resp4" in c or "resp5" in c) for c in ctx[6:])


def test_switches_and_threshold():
    fb = ["", "bad", "", ""]
    ctx = _contexts([1.0, 0.0, 0.0, 0.0], feedbacks=fb, templates=ContextTemplates(use_feedback=False))
    assert ctx[1] == build_teacher_message(P, "resp0", None)
    ctx = _contexts([1.0, 0.0, 0.0, 0.0], feedbacks=fb, templates=ContextTemplates(use_solution=False))
    assert ctx == [None, build_teacher_message(P, None, "bad"), None, None]
    ctx = _contexts([0.6, 0.0, 0.0, 0.0], templates=ContextTemplates(success_threshold=0.7))
    assert ctx == [None] * 4
    keep = ContextTemplates(strip_thinking=False)
    assert "<think>r0</think>resp0" in _contexts([1.0, 0.0, 0.0, 0.0], templates=keep)[1]


def test_rng_choice_is_deterministic_and_varies_with_the_seed():
    rewards = [1.0, 1.0, 1.0, 1.0]
    a = _contexts(rewards, rng=123)
    assert a == _contexts(rewards, rng=123) == _contexts(rewards, rng=random.Random(123))
    chosen = set()
    for seed in range(20):
        ctx = _contexts(rewards, rng=seed)
        assert "resp0" not in ctx[0]
        chosen.add(next(j for j in (1, 2, 3) if f"resp{j}" in ctx[0]))
    assert len(chosen) > 1


def test_truncation_keeps_the_end_within_the_limit():
    t = ContextTemplates(max_solution_chars=20, max_feedback_chars=10)
    sol = "x" * 100 + "\\boxed{42}"
    msg = build_teacher_message(P, sol, "trace line\nValueError: boom", t)
    solution_block = msg.split("Here is a correct solution:\n", 1)[1].split("\n\n", 1)[0]
    assert len(solution_block) == 20 and solution_block.startswith("...") and solution_block.endswith("\\boxed{42}")
    assert "attempt:\n...r: boom\n\n" in msg  # 10 characters: mark + last 7
    short = build_teacher_message(P, "\\boxed{42}", None, t)
    assert "\\boxed{42}\n\n" in short and "..." not in short


def test_errors_are_clear():
    with pytest.raises(ValueError, match="one entry per sample"):
        build_teacher_contexts([P] * 4, ["a"] * 3, [0.0] * 4, [""] * 4, group_size=2)
    with pytest.raises(ValueError, match="groups of 3"):
        build_teacher_contexts([P] * 4, ["a"] * 4, [0.0] * 4, [""] * 4, group_size=3)
    with pytest.raises(ConfigError, match="solution_template"):
        ContextTemplates(solution_template="no field")
    with pytest.raises(ConfigError, match="max_feedback_chars"):
        ContextTemplates(max_feedback_chars=0)
    with pytest.raises(ConfigError, match="rng"):
        build_teacher_contexts([P] * 2, ["a"] * 2, [1.0] * 2, [""] * 2, group_size=2, rng="seed")


# The reference's strings (lasgroup/SDPO and SDPO-CL verl/trainer/config/actor/actor.yaml,
# `self_distillation`; YAML `|-` blocks, so no trailing newline), written out here.
REF_REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."
REF_SOLUTION = "\nCorrect solution:\n\n{successful_previous_attempt}"
REF_FEEDBACK = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}"


@pytest.mark.parametrize(
    "preset", ["qwen3_4b", "qwen3_4b_frozen", "qwen3_4b_stable", "olmo3_7b", "olmo3_7b_frozen_mathfb"]
)
def test_paper_presets_carry_the_reference_reprompt_strings(preset):
    from megatron_sdpo.config import load_config

    ctx = load_config(preset).algorithm.sdpo.context
    assert (ctx.reprompt_template, ctx.solution_template, ctx.feedback_template) == (
        REF_REPROMPT,
        REF_SOLUTION,
        REF_FEEDBACK,
    )
    assert (ctx.truncation, ctx.max_context_tokens, ctx.max_solution_chars, ctx.max_feedback_chars) == (
        "right",
        10240,
        None,
        None,
    )


def _paper(**kw) -> ContextTemplates:
    return ContextTemplates(
        solution_template=REF_SOLUTION,
        feedback_template=REF_FEEDBACK,
        reprompt_template=REF_REPROMPT,
        max_solution_chars=None,
        max_feedback_chars=None,
        **kw,
    )


def test_reference_templates_build_the_reference_message():
    t = _paper()
    # The reference's _build_teacher_message: reprompt_template.format(prompt, solution block, feedback block).
    assert (
        build_teacher_message("Q?", "A=5", None, t)
        == "Q?\nCorrect solution:\n\nA=5\n\nCorrectly solve the original question."
    )
    assert build_teacher_message("Q?", None, "bad box", t) == (
        "Q?\nThe following is feedback from your unsuccessful earlier attempt:\n\nbad box"
        "\n\nCorrectly solve the original question."
    )
    assert build_teacher_message("Q?", "A=5", "bad box", t) == (
        "Q?\nCorrect solution:\n\nA=5\nThe following is feedback from your unsuccessful earlier attempt:\n\nbad box"
        "\n\nCorrectly solve the original question."
    )
    # Braces in the texts are data, not fields.
    assert build_teacher_message("f{x}?", "{y}", None, t).startswith("f{x}?\nCorrect solution:\n\n{y}")


def test_reference_templates_through_the_batch_builder():
    contexts = build_teacher_contexts(
        ["P"] * 3,
        ["<think>w</think>right", "wrong", "wrong"],
        [1.0, 0.0, 0.0],
        [None, "fb1", "fb2"],
        group_size=3,
        templates=_paper(),
    )
    sol = "P\nCorrect solution:\n\nright\n\nCorrectly solve the original question."
    # Sample 0 has no sibling success and no feedback (it succeeded): no context; the others quote it.
    assert contexts == [None, sol, sol]


def test_the_tiny_presets_keep_their_reprompt():
    from megatron_sdpo.algorithms.context import templates_for
    from megatron_sdpo.config import load_config

    ctx = load_config("tiny_sdpo").algorithm.sdpo.context
    assert (ctx.reprompt_template, ctx.truncation) == (None, "left")
    t = templates_for(ctx, "math")
    assert (
        build_teacher_message("Q?", "A=5", None, t)
        == "Q?\n\nHere is a correct solution:\nA=5\n\nNow answer the question correctly."
    )


def test_reprompt_template_needs_its_fields():
    from megatron_sdpo.config import load_config

    with pytest.raises(ConfigError, match=r"\{feedback\}"):
        ContextTemplates(reprompt_template="{prompt}{solution}")
    with pytest.raises(ConfigError, match="reprompt_template must contain the field"):
        load_config("tiny_sdpo", ['algorithm.sdpo.context.reprompt_template="Q: {prompt}{solution}"'])
    with pytest.raises(ConfigError, match="successful_previous_attempt"):
        ContextTemplates(solution_template="no field")


def test_truncation_keeps_the_start_or_the_end():
    from megatron_sdpo.algorithms.context import truncate_context_ids

    ids = list(range(10))
    assert truncate_context_ids(ids, 4, "right") == [0, 1, 2, 3]  # the reference: the start kept
    assert truncate_context_ids(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_context_ids(ids, 4) == [6, 7, 8, 9]  # the default: as before
    assert truncate_context_ids(ids, 10, "right") == ids and truncate_context_ids(ids, None, "right") == ids
    with pytest.raises(ConfigError, match="left' or 'right"):
        truncate_context_ids(ids, 4, "middle")
