"""The command examples of the README and the documents next to it, as a user would copy them,
run against this checkout.

The documents (`documents()`): README.md, every docs/*.md, megatron_sdpo/config/presets/README.md
and megatron_sdpo/rollout/README.md; a test checks that no other Markdown file of the repository
shows a command. The commands are read from the documents themselves (every line of a fenced block
and every inline span that starts `python -m megatron_sdpo`, `megatron-sdpo` or
`torchrun ... -m megatron_sdpo`), so a document change is what gets tested. Every command is parsed
by the CLI. The fenced ones are run in order, the README's first, in one scratch directory (the run
they create is what the later eval / drift / report / resume lines read): the README's with
overrides that shrink the job to seconds (one step per stage, two items per eval split, HF generate
rollout). A command that needs what this test cannot give it is planned instead (`planned_because`):
a torchrun launch, a model other than the tiny ones, the megatron backend, the hub, the benchmark
packages when they are absent, or a training run outside the README (CI time stays the README's):
a `run` runs as `--dry-run` (with the launch's `--world-size`), any other command is only parsed.
Long examples belong in inline spans or as `--dry-run`.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Besides README.md and docs/*.md (all of them, whatever their names): the documents kept next to
# what they describe.
OTHER_DOCUMENTS = ("megatron_sdpo/config/presets/README.md", "megatron_sdpo/rollout/README.md", "dev/LOG.md")
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
TRAINS = ("run", "compare", "study", "eval")


def documents() -> list[Path]:
    """The documents whose commands are tested: README first, then docs/*.md, then the rest."""
    return [README, *sorted((ROOT / "docs").glob("*.md")), *(ROOT / p for p in OTHER_DOCUMENTS)]


@dataclass(frozen=True)
class Command:
    args: tuple[str, ...]  # the CLI's arguments, after the prefix
    ranks: int | None  # processes of a torchrun launch; None: one plain process
    where: str  # the document it came from

    def __str__(self) -> str:
        return f"{self.where}: `{' '.join(self.args)}`" + (f" on {self.ranks} ranks" if self.ranks else "")


def _torchrun_ranks(options: list[str]) -> int:
    """Processes of a torchrun launch from its options (--nproc-per-node x --nnodes)."""
    values: dict[str, str] = {}
    for i, word in enumerate(options):
        name, eq, value = word.partition("=")
        name = name.replace("_", "-")
        if name in ("--nproc-per-node", "--nnodes"):
            values[name] = value if eq else options[i + 1]
    nodes = values.get("--nnodes", "1").split(":")[-1]
    return int(values.get("--nproc-per-node", "1")) * int(nodes)


def _command(line: str, where: str) -> Command | None:
    """The megatron_sdpo command of one line or span, or None when it shows none. A line with a
    `...` placeholder is a template, not a command."""
    rough = line.split()
    if not (
        any(tuple(rough[: len(p)]) == p for p in PREFIXES) or (rough[:1] == ["torchrun"] and "megatron_sdpo" in rough)
    ):
        return None
    words = shlex.split(line, comments=True)
    if any("..." in w for w in words):
        return None
    for prefix in PREFIXES:
        if tuple(words[: len(prefix)]) == prefix:
            return Command(tuple(words[len(prefix) :]), None, where) if words[len(prefix) :] else None
    if words[:1] == ["torchrun"] and "-m" in words:
        i = words.index("-m")
        if words[i + 1 : i + 2] == ["megatron_sdpo"] and words[i + 2 :]:
            return Command(tuple(words[i + 2 :]), _torchrun_ranks(words[1:i]), where)
    return None


def fenced_commands(text: str, where: str = "README.md") -> list[Command]:
    """megatron_sdpo commands of the fenced code blocks, in order."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [c for line in lines if (c := _command(line, where)) is not None]


def inline_commands(text: str, where: str = "README.md") -> list[Command]:
    """megatron_sdpo commands written inline (`python -m megatron_sdpo ...`)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return [c for span in spans if (c := _command(span, where)) is not None]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _markdown_files() -> list[Path]:
    """The repository's Markdown files (git's view where there is one: tracked and new ones)."""
    proc = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0:
        return [ROOT / p for p in proc.stdout.splitlines() if (ROOT / p).is_file()]
    skip = {"runs", "build", "node_modules", "gpu_wheels"}
    return [
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts[:-1])
    ]


def _data_packages_missing() -> bool:
    from megatron_sdpo.data.benchmarks import PACKAGES, package_dir

    return all(package_dir(dist, module) is None for dist, _, module in PACKAGES)


def planned_because(cmd: Command) -> str | None:
    """Why a fenced command is not run in full here (None: it is)."""
    from megatron_sdpo.cli import parse_args

    if cmd.ranks is not None:
        return f"a torchrun launch of {cmd.ranks} ranks"
    parsed = parse_args(list(cmd.args))
    if cmd.args[0] == "results" and parsed.results_command == "operations":
        return "the runs of the study it reads (written by the `study` command before it)"
    if cmd.args[0] == "data":
        if parsed.data_command != "local":
            return "the Hugging Face hub"
        return "the `make data` packages" if _data_packages_missing() else None
    if cmd.args[0] not in TRAINS or getattr(parsed, "dry_run", False):
        return None
    preset = Path(parsed.config).name
    if not preset.startswith("tiny") or Path(parsed.config).suffix:
        return f"the {parsed.config} model (only the tiny presets train here)"
    if {"backend=megatron", "backend.name=megatron"} & set(parsed.overrides):
        return "the megatron backend"
    if cmd.where != "README.md" and cmd.args[0] != "eval":
        return "a training run beyond the README's"
    return None


def test_every_document_with_commands_is_read():
    docs = documents()
    assert all(p.is_file() for p in docs), [_name(p) for p in docs if not p.is_file()]
    names = {_name(p) for p in docs}
    assert {"docs/cluster.md", "docs/custom.md", "dev/LOG.md"} <= names, sorted(names)
    # Every docs/*.md is read whatever its name; elsewhere a document with commands must be listed.
    assert {_name(p) for p in (ROOT / "docs").glob("*.md")} <= names
    unread = []
    for path in _markdown_files():
        if _name(path) not in names:
            text = path.read_text()
            if fenced_commands(text, _name(path)) or inline_commands(text, _name(path)):
                unread.append(_name(path))
    assert not unread, f"documents that show megatron_sdpo commands but are not in documents(): {unread}"


def test_document_commands_parse_and_the_readme_covers_every_command():
    from megatron_sdpo.cli import build_parser, parse_args

    every = []
    for path in documents():
        text = path.read_text()
        every += fenced_commands(text, _name(path)) + inline_commands(text, _name(path))
    readme = fenced_commands(README.read_text())
    assert len(readme) >= 6, readme
    for cmd in every:
        try:
            parse_args(list(cmd.args))  # raises UserError on anything the CLI would reject
        except Exception as exc:
            raise AssertionError(f"{cmd} does not parse: {exc}") from exc
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    missing = set(sub.choices) - {cmd.args[0] for cmd in readme}
    assert not missing, f"README shows no example of: {sorted(missing)}"


def test_commands_that_need_more_are_planned_not_trained():
    cases = {
        "torchrun --standalone --nproc-per-node 2 -m megatron_sdpo run tiny rollout.engine=vllm": "torchrun",
        "torchrun --nnodes=2 --nproc_per_node=8 -m megatron_sdpo run olmo3_7b": "16 ranks",
        "python -m megatron_sdpo run smollm2_135m": "smollm2_135m",
        "python -m megatron_sdpo run tiny backend=megatron": "megatron",
        "python -m megatron_sdpo data prepare qwen3_4b --out data": "hub",
        "python -m megatron_sdpo run tiny_sdpo": None,
        "python -m megatron_sdpo run qwen3_4b --dry-run --world-size 8": None,
        "python -m megatron_sdpo presets": None,
    }
    for line, why in cases.items():
        cmd = _command(line, "README.md")
        got = planned_because(cmd)
        assert (got is None) if why is None else (got is not None and why in got), (line, got)
    outside = _command("python -m megatron_sdpo compare tiny --algorithms grpo,sdpo", "docs/custom.md")
    assert "beyond the README" in planned_because(outside)
    assert _command("python -m megatron_sdpo run PRESET [key=value ...] --out RUN_DIR", "x.md") is None


@pytest.mark.slow
@pytest.mark.timeout(1800)  # seven CLI processes, four of them (shrunk) runs, and a few dry runs: minutes on 2 cores
def test_document_fenced_commands_run(tmp_path):
    from megatron_sdpo.cli import parse_args

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The committed study data `results tabulate` reads (a copy: the command rewrites its tables).
    shutil.copytree(ROOT / "results", tmp_path / "results")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "findings.md", tmp_path / "docs" / "findings.md")
    seen = set()
    for path in documents():
        for cmd in fenced_commands(path.read_text(), _name(path)):
            if (cmd.args, cmd.ranks) in seen:
                continue  # the same command twice (a document repeating the README's)
            seen.add((cmd.args, cmd.ranks))
            why = planned_because(cmd)
            args = list(cmd.args)
            if why is not None:
                if args[0] != "run":
                    continue  # parsed by the test above; nothing here can run it
                args += [] if "--dry-run" in args else ["--dry-run"]
                args += ["--world-size", str(cmd.ranks)] if cmd.ranks and "--world-size" not in args else []
            dry = "--dry-run" in args
            extra = [] if dry else SHRINK.get(args[0], [])
            proc = subprocess.run(
                [sys.executable, "-m", "megatron_sdpo", *args, *extra],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            shown = f"{cmd}" + (f" (as `{' '.join(args)}`: needs {why})" if why else "")
            assert proc.returncode == 0, f"{shown} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            assert "Traceback" not in proc.stderr, f"{shown}:\n{proc.stderr[-3000:]}"
            parsed = parse_args(args)
            out = getattr(parsed, "out", None)
            if dry:
                assert "dry run of" in proc.stdout and "peak:" in proc.stdout, proc.stdout[-2000:]
            elif args[0] == "run":
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
            elif args[0] == "results" and args[1] == "tabulate":
                # The tables regenerated from the committed data are the committed tables.
                for name in re.findall(r"wrote (\S+)", proc.stdout):
                    assert (tmp_path / name).read_bytes() == (ROOT / name).read_bytes(), name
            elif args[0] == "results" and args[1] == "render":
                for name in args[2:]:
                    assert (tmp_path / name).read_bytes() == (ROOT / name).read_bytes(), name


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }


def test_every_relative_link_resolves():
    # Files move (the lab log left docs/): a link into a moved file, or to a heading it no longer
    # has, fails here rather than in a reader's browser.
    broken = []
    for path in _markdown_files():
        prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{_name(path)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_name(path)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
