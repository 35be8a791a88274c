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
    assert build_teacher_message(P, "", "fb") == P + "\n\nFeedback on an earlier attempt:\nfb\n\nNow answer the question correctly."


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
