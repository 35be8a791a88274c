"""Rows of the paper's reference files (lasgroup/SDPO's `datasets/`, which Moenupa/SDPO-CL trains
on unchanged): the tool-use and SciKnowEval rows carry their task inside a rendered prompt
(`prompt`, `answer`, `idx`, `kind`, ...), not as fields. These read the fields back out of the
prompt, as the reference rendered it:

- tool use (ToolAlpaca): "You have access to the following tools:" then, per API, `Name:`,
  `Description:`, `Documentation:` and per function `<name>: <description>` followed by
  `Parameters: <JSON object>`; then the ReAct format instruction and `Question: <request>`;
- SciKnowEval (data/format/sciknoweval.py there): `<question>\\n\\nA: <choice>\\nB: ...` then
  `\\nPlease reason step by step.`; `answer` is the letter.
"""

from __future__ import annotations

import json
import re

REFERENCE_REPO = "lasgroup/SDPO"
# The commit whose datasets/ the paper's runs read (Moenupa/SDPO-CL's data files equal these).
REFERENCE_COMMIT = "0e6d5106abe69f578c63bf38a9394e22905c8773"

_FUNCTION = re.compile(r"^([^\s:]+): (.*)\nParameters: (.*)$", re.MULTILINE)
_CHOICE = re.compile(r"\n(?=[B-Z]: )")
_MCQ_TAIL = "\nPlease reason step by step."


class ReferenceRowError(ValueError):
    """A reference row whose rendered prompt does not have the reference's layout (the loaders
    report it as the row's error)."""


def tool_docs_from_prompt(prompt: str) -> list[dict]:
    """[{"name", "description", "parameters"}] of every function documented in a rendered
    ToolAlpaca prompt (parameters: the JSON object the prompt shows, name -> "type. description")."""
    if "Documentation:\n" not in prompt:
        raise ReferenceRowError("the prompt has no 'Documentation:' block of tools")
    tools: list[dict] = []
    for block in prompt.split("Documentation:\n")[1:]:
        block = block.split("\n\nUse the following format:")[0].split("\nName: ")[0]
        for name, description, params in _FUNCTION.findall(block):
            try:
                parameters = json.loads(params)
            except json.JSONDecodeError:
                raise ReferenceRowError(f"the parameters of {name!r} are not a JSON object") from None
            if not isinstance(parameters, dict):
                raise ReferenceRowError(f"the parameters of {name!r} are not a JSON object")
            tools.append({"name": name, "description": description.strip(), "parameters": parameters})
    if not tools:
        raise ReferenceRowError("the prompt's 'Documentation:' block documents no function")
    return tools


def tool_question(prompt: str) -> str:
    """The user's request: what follows the last `Question:` of a rendered ToolAlpaca prompt."""
    if "Question:" not in prompt:
        raise ReferenceRowError("the prompt has no 'Question:'")
    return prompt.rsplit("Question:", 1)[1].strip()


def mcq_from_prompt(prompt: str) -> tuple[str, list[str]]:
    """(question, choice texts in letter order) of a rendered SciKnowEval prompt."""
    body = prompt[: -len(_MCQ_TAIL)] if prompt.endswith(_MCQ_TAIL) else prompt
    if "\n\nA: " not in body:
        raise ReferenceRowError("the prompt has no choices block ('\\n\\nA: ...')")
    question, options = body.rsplit("\n\nA: ", 1)
    parts = _CHOICE.split("A: " + options)
    choices = []
    for i, part in enumerate(parts):
        label = chr(ord("A") + i)
        if not part.startswith(f"{label}: "):
            raise ReferenceRowError(f"choice {i + 1} is not labelled {label!r}")
        choices.append(part[len(label) + 2 :].strip())
    if len(choices) < 2:
        raise ReferenceRowError("the prompt lists fewer than two choices")
    return question.strip(), choices
