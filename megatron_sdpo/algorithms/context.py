"""Teacher context: the re-prompt that gives the self-teacher privileged information.

message = prompt + "\\n\\n" + [solution block] + [feedback block] + instruction, or with a
whole-message template (the reference's `reprompt_template`):
message = reprompt_template.format(prompt=..., solution=[block or ""], feedback=[block or ""])

The solution block carries a *successful sibling* (another sample of the same prompt that the
verifier accepted; never the sample itself), the feedback block the environment's feedback on
the sample's own failed attempt. The student's response tokens are later appended unchanged to
the tokenized message, so teacher and student score the same tokens.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from megatron_sdpo.errors import ConfigError

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_TRUNCATION_MARK = "..."
# This project's field names, then the reference's (lasgroup/SDPO `solution_template` /
# `feedback_template`), so its template strings work verbatim.
_SOLUTION_FIELDS = ("{solution}", "{successful_previous_attempt}")
_FEEDBACK_FIELDS = ("{feedback}", "{feedback_raw}")


@dataclass(frozen=True)
class ContextTemplates:
    """How the teacher re-prompt is written.

    solution_template / feedback_template: blocks with a `{solution}` / `{feedback}` field (or
        the reference's names for them, `{successful_previous_attempt}` / `{feedback_raw}`).
    instruction: the closing instruction (without `reprompt_template`).
    reprompt_template: None, or the whole message with the fields {prompt}, {solution} and
        {feedback} (the formatted blocks, "" when absent); `instruction` is then unused.
    max_solution_chars / max_feedback_chars: longer texts are cut to this many characters
        (None: no limit). The *end* is kept and the cut marked with "...": the final answer of a
        solution and the last lines of an error trace are the informative parts.
    use_solution / use_feedback: whether each block is used at all.
    feedback_only_without_solution: use the feedback only for samples without a successful
        sibling (the reference's `environment_feedback_only_without_solution`).
    success_threshold: a reward >= this marks a successful attempt.
    strip_thinking: remove `<think>...</think>` from the sibling's solution before quoting it.
    """

    solution_template: str = "Here is a correct solution:\n{solution}\n\n"
    feedback_template: str = "Feedback on an earlier attempt:\n{feedback}\n\n"
    instruction: str = "Now answer the question correctly."
    max_solution_chars: int | None = 4096
    max_feedback_chars: int | None = 2048
    use_solution: bool = True
    use_feedback: bool = True
    success_threshold: float = 0.5
    strip_thinking: bool = True
    feedback_only_without_solution: bool = True
    reprompt_template: str | None = None

    def __post_init__(self) -> None:
        if not any(f in self.solution_template for f in _SOLUTION_FIELDS):
            raise ConfigError(
                "context.solution_template must contain the field {solution} (or {successful_previous_attempt})"
            )
        if not any(f in self.feedback_template for f in _FEEDBACK_FIELDS):
            raise ConfigError("context.feedback_template must contain the field {feedback} (or {feedback_raw})")
        if self.reprompt_template is not None:
            for f in ("{prompt}", "{solution}", "{feedback}"):
                if f not in self.reprompt_template:
                    raise ConfigError(f"context.reprompt_template must contain the field {f}")
        for name in ("max_solution_chars", "max_feedback_chars"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= len(_TRUNCATION_MARK)
            ):
                raise ConfigError(f"context.{name} must be None or an integer > {len(_TRUNCATION_MARK)}, got {value!r}")


def strip_thinking(text: str) -> str:
    """Remove reasoning spans: every `<think>...</think>` block, an unclosed `<think>` up to the
    end of the text, and everything before a stray `</think>` (chat templates such as Qwen3's put
    the opening `<think>` in the prompt, so the response holds only the closing tag).
    Surrounding whitespace is stripped."""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text.strip()


def _truncate(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return _TRUNCATION_MARK + text[len(text) - (limit - len(_TRUNCATION_MARK)) :]


def build_teacher_message(
    prompt: str,
    solution: str | None,
    feedback: str | None,
    templates: ContextTemplates = ContextTemplates(),
) -> str:
    """The teacher's user message for one sample.

    Args:
        prompt: the student's full user message.
        solution: a successful sibling's response (already stripped of thinking), or None.
        feedback: the environment's feedback on this sample's attempt, or None.
        templates: formatting; solution and feedback are truncated to its limits.

    Returns:
        prompt + "\\n\\n" + [solution block] + [feedback block] + instruction, or the
        `reprompt_template` filled with them. A None or empty solution/feedback leaves its
        block out.
    """
    sol = fb = ""
    if solution:
        text = _truncate(solution, templates.max_solution_chars)
        sol = templates.solution_template.format(solution=text, successful_previous_attempt=text)
    if feedback:
        text = _truncate(feedback, templates.max_feedback_chars)
        fb = templates.feedback_template.format(feedback=text, feedback_raw=text)
    if templates.reprompt_template is not None:
        return templates.reprompt_template.format(prompt=prompt, solution=sol, feedback=fb)
    return "".join([prompt, "\n\n", sol, fb, templates.instruction])


def _as_rng(rng: random.Random | int | None) -> random.Random | None:
    if rng is None or isinstance(rng, random.Random):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return random.Random(rng)
    raise ConfigError(f"rng must be a random.Random, an integer seed or None, got {type(rng).__name__}")


def build_teacher_contexts(
    prompts: list[str],
    responses: list[str],
    rewards: list[float],
    feedbacks: list[str | None],
    *,
    group_size: int,
    templates: ContextTemplates = ContextTemplates(),
    rng: random.Random | int | None = None,
) -> list[str | None]:
    """Teacher messages for a batch of grouped samples.

    Args:
        prompts: one per sample (samples of a prompt consecutive, `group_size` each).
        responses: the samples' responses.
        rewards: the samples' rewards.
        feedbacks: the verifier's feedback per sample ("" or None when it has none).
        group_size: samples per prompt.
        templates: formatting and selection settings.
        rng: chooses among several successful siblings (random.Random or a seed; the same
            seed gives the same choice). None picks the first successful sibling.

    Returns:
        One entry per sample: the teacher message, or None when the sample has neither a
        successful sibling (other than itself) nor feedback on a failed attempt. Feedback is
        used only for failed attempts (reward < threshold). `context_mask` turns the list
        into the [B] mask of samples with a context.
    """
    n = len(prompts)
    if not (len(responses) == len(rewards) == len(feedbacks) == n):
        raise ValueError(
            f"prompts, responses, rewards and feedbacks must have one entry per sample, got "
            f"{n}, {len(responses)}, {len(rewards)}, {len(feedbacks)}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer, got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(f"{n} samples do not split into groups of {group_size}")
    gen = _as_rng(rng)
    success = [float(r) >= templates.success_threshold for r in rewards]
    quoted = quoted_siblings(success, group_size, gen) if templates.use_solution else [None] * n
    # Strip each successful response once, not once per sibling that quotes it.
    cleaned: dict[int, str] = {}
    contexts: list[str | None] = []
    for i in range(n):
        solution = None
        j = quoted[i]
        if j is not None:
            if j not in cleaned:
                cleaned[j] = strip_thinking(responses[j]) if templates.strip_thinking else responses[j]
            solution = cleaned[j] or None
        feedback = None
        if templates.use_feedback and not success[i] and feedbacks[i]:
            if solution is None or not templates.feedback_only_without_solution:
                feedback = feedbacks[i]
        if solution is None and feedback is None:
            contexts.append(None)
        else:
            contexts.append(build_teacher_message(prompts[i], solution, feedback, templates))
    return contexts


def quoted_siblings(success: list[bool], group_size: int, rng: random.Random | int | None = None) -> list[int | None]:
    """Per sample, the successful sibling its teacher prompt quotes: another successful sample of
    its group (consecutive groups of `group_size`), the first one, or one chosen by `rng`; None
    where there is none. Draws from `rng` sample by sample, in order."""
    gen = _as_rng(rng)
    out: list[int | None] = []
    for i in range(len(success)):
        start = (i // group_size) * group_size
        siblings = [j for j in range(start, start + group_size) if j != i and success[j]]
        out.append(None if not siblings else siblings[0] if gen is None else gen.choice(siblings))
    return out


def teacher_feedbacks(context, domain: str, results: list, truncated: list[bool]) -> list[str | None]:
    """The feedback texts the teacher prompt may quote, per scored sample: each result's own, or
    with `algorithm.sdpo.context.math_feedback: format` on math the reference's format-only
    feedback (`truncated`: the responses cut at max_new_tokens)."""
    if domain == "math" and context.math_feedback == "format":
        from megatron_sdpo.rewards.math import format_feedback

        return [format_feedback(r, t) for r, t in zip(results, truncated, strict=True)]
    return [r.feedback for r in results]


def templates_for(context, domain: str) -> ContextTemplates:
    """The ContextTemplates of `algorithm.sdpo.context` (ContextConfig) for one domain: feedback
    only where `use_feedback` is on and the domain is in `feedback_domains`."""
    from dataclasses import asdict, fields

    names = {f.name for f in fields(ContextTemplates)}
    kw = {k: v for k, v in asdict(context).items() if k in names}
    kw["use_feedback"] = bool(context.use_feedback) and domain in context.feedback_domains
    return ContextTemplates(**kw)


def truncate_context_ids(ids: list[int], max_tokens: int | None, side: str = "left") -> list[int]:
    """The tokenized teacher prompt cut to `max_tokens` tokens (None: no limit). side "left"
    drops the start (the instruction and the demonstration's end are kept); "right" drops the
    end and keeps the start, as the reference's `reprompt_truncation: right` (the tokenizer's
    truncation side), which can cut the instruction and the generation prompt."""
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    if side == "right":
        return ids[:max_tokens]
    if side != "left":
        raise ConfigError(f"context truncation side must be 'left' or 'right', got {side!r}")
    return ids[len(ids) - max_tokens :]


def context_mask(contexts: list[str | None]) -> torch.Tensor:
    """[B] fp32 mask, 1 where a sample has a teacher context (multiply into the [B, T] loss mask)."""
    return torch.tensor([0.0 if c is None else 1.0 for c in contexts], dtype=torch.float32)
