"""The README's command examples, as a user would copy them, run against this checkout.

The commands are read from README.md itself (every fenced shell block and every inline
`python -m megatron_sdpo ...` span), so a README change is what gets tested. Every command is
parsed by the CLI; the fenced ones are run in order in one scratch directory (the run they
create is what the later eval / drift / report / resume lines read), each with overrides that
shrink the job to seconds: one step per stage, two items per eval split, HF generate rollout.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
PREFIXES = (("python", "-m", "megatron_sdpo"), ("megatron-sdpo",))
DOMAINS = ("math", "science", "tooluse", "code")
SPLITS = ("id", "ood_near", "ood_mid", "ood_far")
EVERY_RUN = [
    *(f"domains.{d}.eval.{s}.n=2" for d in DOMAINS for s in SPLITS),
    "algorithm.prompts_per_step=2",
    "algorithm.group_size=2",
    "rollout.engine=hf",
    "rollout.max_new_tokens=8",
    "eval.max_new_tokens=8",
    "diagnostics.probe_n=1",
    "diagnostics.response_drift=false",  # no sentence-embedding model to load
    "checkpoint.save_every=0",
]
# The run the later lines read keeps the preset's four stages (the README names stage_2_science
# and stage_4_code); compare's and study's arms only need to finish, so they get two.
SHRINK = {
    "run": [*(f"stages.{i}.steps=1" for i in range(4)), *EVERY_RUN],
    "eval": EVERY_RUN,
    "compare": ["stages=[{domain: math, steps: 1}, {domain: code, steps: 1}]", *EVERY_RUN],
    "study": ["stages=[{domain: math, steps: 1}, {domain: code, steps: 1}]", *EVERY_RUN, "--bootstrap", "50"],
}


def _cli_args(line: str) -> list[str] | None:
    """The CLI arguments of one README line, or None when it is not a megatron_sdpo command."""
    words = shlex.split(line, comments=True)
    for prefix in PREFIXES:
        if tuple(words[: len(prefix)]) == prefix:
            return words[len(prefix) :]
    return None


def fenced_commands(text: str) -> list[list[str]]:
    """megatron_sdpo commands of the fenced code blocks, in order."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    return [args for block in blocks for line in block.splitlines() if (args := _cli_args(line)) is not None]


def inline_commands(text: str) -> list[list[str]]:
    """megatron_sdpo commands written inline (`python -m megatron_sdpo ...`)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return [args for span in spans if (args := _cli_args(span)) is not None and args and args[0] != "..."]


def test_readme_commands_parse_and_cover_every_command():
    from megatron_sdpo.cli import build_parser, parse_args

    text = README.read_text()
    fenced, inline = fenced_commands(text), inline_commands(text)
    assert len(fenced) >= 6, fenced
    for args in fenced + inline:
        parse_args(args)  # raises UserError on anything the CLI would reject
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    missing = set(sub.choices) - {args[0] for args in fenced}
    assert not missing, f"README shows no example of: {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # seven CLI processes, four of them (shrunk) runs: minutes on 2 cores
def test_readme_fenced_commands_run(tmp_path):
    from megatron_sdpo.cli import parse_args

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in fenced_commands(README.read_text()):
        extra = SHRINK.get(args[0], [])
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_sdpo", *args, *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        shown = " ".join(args)
        assert proc.returncode == 0, f"`{shown}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"`{shown}`:\n{proc.stderr[-3000:]}"
        parsed = parse_args(args)
        out = getattr(parsed, "out", None)
        if args[0] == "run":
            assert (tmp_path / out / "report.md").is_file(), shown
            assert (tmp_path / out / "logs" / "engine.log").is_file(), shown
        elif args[0] == "compare":
            assert all((tmp_path / out / a / "report.md").is_file() for a in parsed.algorithms.split(",")), shown
        elif args[0] == "study":
            assert (tmp_path / out / "study.md").is_file() and (tmp_path / out / "study.csv").is_file(), shown
        elif args[0] == "drift":
            assert (tmp_path / out / "drift.json").is_file(), shown
        elif args[0] == "eval":
            assert re.search(r"math/id\s+\d\.\d{3}", proc.stdout), proc.stdout[-2000:]
        elif args[0] == "presets":
            assert "tiny" in proc.stdout.split()
