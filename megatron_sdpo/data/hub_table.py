"""The paper's datasets on the Hugging Face hub (`megatron-sdpo data prepare PRESET --out DIR`).

One row per set: hub id, config, split, the columns its conversion reads, licence, and the files
it writes (the names the paper presets read under data/). UNVERIFIED: the ids, configs and
columns were assembled from the dataset cards and the reference code, not from a fetch (this
project's machines cannot reach the hub); the first real fetch records each set's revision in
manifest.json, and a set whose columns differ fails with a one-line error naming them.

`prepare` reads the same table from a local copy instead (`--from DIR`: DIR/<hub id>/[<config>/]
with the split's parquet / jsonl files, as `datasets` loads a folder; raw-file sets keep their
file paths), which is how the tests drive every conversion without network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_sdpo.data import dolci_rows, dolci_set
from megatron_sdpo.data.dataset_files import DatasetFile
from megatron_sdpo.data.packed_tests import PackedError, json_text
from megatron_sdpo.data.reference_rows import REFERENCE_COMMIT, REFERENCE_REPO
from megatron_sdpo.errors import DataError, UserError

VERIFIED = False  # flip after a first real fetch has confirmed every row of TABLE
DATA_EXTRA = "pip install -e .[data]"
GITHUB_RAW = "https://raw.githubusercontent.com/{repo}/{ref}/{path}"

Rows = list[dict]
Converted = dict[str, tuple[Rows, list[str]]]  # output file -> (rows, "id: reason" not converted)


@dataclass(frozen=True)
class HubSet:
    name: str
    repo: str  # hub dataset id (or the GitHub repository for ToolAlpaca)
    split: str
    columns: tuple[str, ...]  # what the conversion reads; checked before converting
    license: str
    outputs: tuple[str, ...]  # files written, as the paper presets name them
    schema: str | None  # loader schema of the outputs (None: no loader reads them yet)
    convert: Callable[[Rows], Converted]
    config: str | None = None  # None: the default config; "*": every config (a "config" key is added)
    files: tuple[str, ...] = ()  # raw files fetched instead of a `datasets` split
    gated: bool = False
    github: str | None = None  # the commit of `repo` on GitHub the files are read at
    revision: str | None = None  # a pinned hub revision (None: the current one, recorded)
    package: tuple[str, str, str] | None = None  # (distribution, version, module): files from a wheel
    split_rule: str = ""  # how the outputs are split or filtered (docs/data.md's table)
    # Rows whose key was seen already are dropped while the split is read (the DAPO file repeats
    # each problem ~100 times: 1.8M rows that are never held at once).
    unique: Callable[[dict], str] | None = None
    streamed: bool = False  # prepared one row at a time (dolci_set): the rows are never all held


# ----------------------------------------------------------------------------- conversions


def _split(rows: Rows, key: Callable[[dict], str], test_fraction: float = 0.1, seed: int = 42) -> tuple[Rows, Rows]:
    """Deterministic train / test split by question (as the reference: 90/10, seed 42)."""
    order = sorted(rows, key=key)
    random.Random(seed).shuffle(order)
    n_test = max(1, round(len(order) * test_fraction)) if len(order) > 1 else 0
    return order[n_test:], order[:n_test]


def _dedupe(rows: Rows, key: Callable[[dict], str]) -> Rows:
    seen: set[str] = set()
    out = []
    for r in rows:
        k = key(r)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def _one(name: str) -> Callable[[Rows], Converted]:
    return lambda rows: {name: (rows, [])}


def _dapo_key(row: dict) -> str:
    return json.dumps(row.get("prompt"), sort_keys=True)


def _dapo(rows: Rows) -> Converted:
    # The hub file repeats each of its ~17k problems many times: one copy each (already while
    # reading, HubSet.unique; again here for rows handed in directly).
    return {"dapo-math-17k.parquet": (_dedupe(rows, _dapo_key), [])}


def _redux_answer(value: Any, n: int) -> int | None:
    """MMLU-Redux's `correct_answer` as a choice index (an index or a letter), else None."""
    text = str(value).strip() if value is not None else ""
    if text.isdigit() and int(text) < n:
        return int(text)
    if len(text) == 1 and "A" <= text.upper() < chr(ord("A") + n):
        return ord(text.upper()) - ord("A")
    return None


def _mmlu_redux(rows: Rows) -> Converted:
    """The MMLU-Redux authors' advice: evaluate on the questions annotated `ok`; a
    `wrong_groundtruth` question whose annotators give the correct choice is kept with it; the
    other error types (no or several correct answers, unclear question or options, expert) are
    left out, each named."""
    out, bad = [], []
    seen: dict[str, int] = {}
    for r in rows:
        config = str(r.get("config", ""))
        seen[config] = seen.get(config, -1) + 1
        kind = str(r.get("error_type") or "ok")
        rid = f"{config}/{seen[config]}"  # the row's place in its subject's split
        if kind == "ok":
            out.append({**r, "subject": r.get("config", ""), "source": "mmlu_redux"})
            continue
        fixed = (
            _redux_answer(r.get("correct_answer"), len(r.get("choices") or [])) if kind == "wrong_groundtruth" else None
        )
        if fixed is None:
            bad.append(f"{rid}: error_type {kind} (left out)")
            continue
        out.append({**r, "answer": fixed, "subject": r.get("config", ""), "source": "mmlu_redux"})
    return {"mmlu_redux.jsonl": (out, bad)}


def _by_file(names: dict[str, str]) -> Callable[[Rows], Converted]:
    """The reference's committed files as they are: each input file to its output file."""

    def convert(rows: Rows) -> Converted:
        out: Converted = {name: ([], []) for name in names.values()}
        for r in rows:
            out[names[r.pop("_file")]][0].append(r)
        return out

    return convert


def _lcb_private(value: Any) -> Any:
    """LiveCodeBench's private cases are base64(zlib(pickle(JSON string))): read as plain data
    (packed_tests) and stored as the JSON string the loader reads."""
    if not isinstance(value, str) or value.strip().startswith("[") or not value.strip():
        return value
    return json_text(value)


# The reference evaluates on the problems of contests from this date on (its
# data/utils/livecodebench.py: LCB_TEST_CUTOFF), at the hub revision below.
LCB_WINDOW_START = "2025-02-01"
LCB_REVISION = "refs/pr/6"


def _livecodebench(rows: Rows) -> Converted:
    out, bad = [], []
    for r in rows:
        date = str(r.get("contest_date") or "")
        if not date:
            bad.append(f"{r.get('question_id', '?')}: no contest_date")
            continue
        if date[:10] < LCB_WINDOW_START:
            continue  # before the reference's window: not part of the set
        try:
            out.append({**r, "private_test_cases": _lcb_private(r.get("private_test_cases"))})
        except PackedError as exc:  # a malformed or non-data pickle: named, not fatal
            bad.append(f"{r.get('question_id', '?')}: private tests unreadable ({exc})")
    return {"livecodebench_v6.jsonl": (out, bad)}


def _dolci_code(rows: Rows) -> Converted:
    """The rows of a Dolci split held in memory (convert_set; `prepare` streams: dolci_set),
    converted and split as the stream is."""
    tally = dolci_set.Tally()
    tests = dolci_set.test_keys(dolci_set.split_key(r) for r in rows if tally.first_pass(r))
    train: Rows = []
    test: Rows = []
    for to_test, row in dolci_set.converted(rows, tests, tally, None):
        (test if to_test else train).append(row)
    return {"dolci_think_rl_code.jsonl": (train, tally.named), "dolci_think_rl_code_test.jsonl": (test, [])}


def _aime(name: str) -> Callable[[Rows], Converted]:
    return lambda rows: {f"{name}.jsonl": ([{**r, "source": name} for r in rows], [])}


def _reference_set(name: str, license: str, schema: str, files: dict[str, str], split_rule: str) -> HubSet:
    """A set read from the reference's committed files at the pinned commit, file for file."""
    return HubSet(
        name,
        REFERENCE_REPO,
        "",
        (),
        license,
        tuple(files.values()),
        schema,
        _by_file(files),
        files=tuple(files),
        github=REFERENCE_COMMIT,
        split_rule=split_rule,
    )


TABLE: tuple[HubSet, ...] = (
    HubSet(
        "dapo_math",
        "BytedTsinghua-SIA/DAPO-Math-17k",
        "train",
        ("prompt", "reward_model", "data_source"),
        "Apache-2.0",
        ("dapo-math-17k.parquet",),
        "dapo_math",
        _dapo,
        unique=_dapo_key,
        split_rule="one copy per problem (the hub file repeats them)",
    ),
    HubSet(
        "aime24",
        "HuggingFaceH4/aime_2024",
        "train",
        ("problem", "answer"),
        "MAA competition problems",
        ("aime24.jsonl",),
        "aime",
        _aime("aime24"),
    ),
    HubSet(
        "aime25",
        "math-ai/aime25",
        "test",
        ("problem", "answer"),
        "MAA competition problems",
        ("aime25.jsonl",),
        "aime",
        _aime("aime25"),
    ),
    HubSet(
        "math500",
        "HuggingFaceH4/MATH-500",
        "test",
        ("problem", "solution", "answer", "unique_id"),
        "MIT",
        ("math500.jsonl",),
        "math500",
        _one("math500.jsonl"),
    ),
    HubSet(
        "gpqa_diamond",
        "Idavidrein/gpqa",
        "train",
        ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3", "Record ID"),
        "CC-BY-4.0",
        ("gpqa_diamond.jsonl",),
        "gpqa",
        _one("gpqa_diamond.jsonl"),
        config="gpqa_diamond",
        gated=True,
    ),
    HubSet(
        "mmlu_redux",
        "edinburgh-dawg/mmlu-redux-2.0",
        "test",
        ("question", "choices", "answer", "error_type"),
        "CC-BY-4.0",
        ("mmlu_redux.jsonl",),
        "mmlu_redux",
        _mmlu_redux,
        config="*",
        split_rule="every subject; `ok` rows, `wrong_groundtruth` rows with their corrected answer, the "
        "other error types left out",
    ),
    _reference_set(
        "sciknoweval_chem_l3",
        "MIT (SciKnowEval); split: Apache-2.0 (lasgroup/SDPO)",
        "sciknoweval",
        {
            "datasets/sciknoweval/chemistry/train.json": "sciknoweval_chem_l3.jsonl",
            "datasets/sciknoweval/chemistry/test.json": "sciknoweval_chem_l3_test.jsonl",
        },
        "the reference's committed split: chemistry, L3, multiple choice; 90/10 with seed 42 in hub "
        "order (1,890 / 210)",
    ),
    _reference_set(
        "toolalpaca",
        "Apache-2.0 (ToolAlpaca; lasgroup/SDPO)",
        "toolalpaca",
        {
            "datasets/tooluse/train.json": "toolalpaca_train.jsonl",
            "datasets/tooluse/test.json": "toolalpaca_test.jsonl",
        },
        "the reference's committed train / test files (68 test rows)",
    ),
    HubSet(
        "bfcl_v4_multiple",
        "bfcl-eval",
        "",
        (),
        "Apache-2.0",
        ("bfcl_v4_multiple.jsonl",),
        "bfcl_multiple",
        _one("bfcl_v4_multiple.jsonl"),
        files=("data/BFCL_v4_multiple.json", "data/possible_answer/BFCL_v4_multiple.json"),
        package=("bfcl-eval", "2026.3.23", "bfcl_eval"),
        split_rule="BFCL v4 `multiple` with its possible answers, as the wheel ships them",
    ),
    HubSet(
        "livecodebench_v6",
        "livecodebench/code_generation_lite",
        "",
        ("question_id", "question_content", "public_test_cases", "private_test_cases", "metadata", "contest_date"),
        "CC-BY-4.0",
        ("livecodebench_v6.jsonl",),
        "livecodebench",
        _livecodebench,
        files=("test6.jsonl",),
        revision=LCB_REVISION,
        split_rule=f"the reference's window: contests from {LCB_WINDOW_START} on, at hub revision {LCB_REVISION}",
    ),
    HubSet(
        "dolci_code",
        "allenai/Dolci-Think-RL-7B",
        "train",
        dolci_set.KEPT,
        "ODC-BY-1.0",
        ("dolci_think_rl_code.jsonl", "dolci_think_rl_code_test.jsonl"),
        "dolci_code",
        _dolci_code,
        streamed=True,
        split_rule="the rows whose dataset[0] is `code` or `code_stdio`, 90/10 by distinct prompt ('user: ' "
        "dropped) with seed 42; packed tests stored as JSON; per row, tests with an output over "
        f"the sandbox's {dolci_rows.MAX_OUTPUT_CHARS:,} characters dropped and the tests kept within "
        f"{dolci_rows.MAX_TESTS_BYTES:,} bytes",
    ),
    HubSet(
        "zebralogic",
        "WildEval/ZebraLogic",
        "test",
        ("id", "puzzle", "solution"),
        "CC-BY-4.0",
        ("zebralogic.jsonl",),
        None,
        _one("zebralogic.jsonl"),
        config="grid_mode",
    ),
)
BY_OUTPUT = {out: hs for hs in TABLE for out in hs.outputs}


# ----------------------------------------------------------------------------- fetching


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(f"`data prepare` needs the datasets library: {DATA_EXTRA}") from None
    datasets.disable_progress_bars()
    return datasets


def _hub_error(hs: HubSet, exc: Exception) -> DataError:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if hs.gated and ("gated" in text.lower() or "401" in text or "403" in text):
        return DataError(
            f"{hs.repo} is gated: accept its terms on the Hugging Face hub with your account, "
            "then set HF_TOKEN to a token of that account (or run `hf auth login`)"
        )
    return DataError(f"{hs.name}: cannot fetch {hs.repo}: {text[:300]}")


def _revision(hs: HubSet) -> str:
    if hs.github:
        return hs.github  # pinned: the paper's files, whatever the repository holds today
    if hs.revision:
        return hs.revision
    from huggingface_hub import HfApi

    return str(HfApi().dataset_info(hs.repo).sha)


def _package_rows(hs: HubSet) -> tuple[Rows, dict[str, Any]]:
    """A set shipped in a wheel (`make data` installs it): its files at the pinned version."""
    from megatron_sdpo.data.benchmarks import package_dir

    assert hs.package is not None
    dist, version, module = hs.package
    found = package_dir(dist, module)
    if found is None:
        raise DataError(
            f"{hs.name}: needs the {dist}=={version} package: run `make data` (pip install --no-deps {dist}=={version})"
        )
    root, installed = found
    if installed != version:
        raise DataError(
            f"{hs.name}: {dist} {installed} is installed; the table reads {version} "
            f"(pip install --no-deps {dist}=={version})"
        )
    rows = [r for f in hs.files for r in _file_rows(hs, f, root / f)]
    return rows, {"package": dist, "version": version, "path": f"{module}/{hs.files[0]}"}


def _local_rows(hs: HubSet, root: Path) -> Rows:
    base = root / hs.repo
    if not base.is_dir():
        raise DataError(f"{hs.name}: no local copy of {hs.repo} under {root}")
    if hs.files:
        return [r for f in hs.files for r in _file_rows(hs, f, base / f)]
    datasets = _datasets()
    configs = sorted(p.name for p in base.iterdir() if p.is_dir()) if hs.config == "*" else [hs.config]
    rows: Rows = []
    for config in configs:
        folder = base / config if config else base
        with _local_split(datasets, hs, folder) as ds:
            rows += _collect(hs, ds, config)
    return rows


@contextlib.contextmanager
def _local_split(datasets, hs: HubSet, folder: Path):
    """`hs`'s split of a local copy; the datasets cache lives in a temporary folder while it is read."""
    with tempfile.TemporaryDirectory() as cache:
        try:
            ds = datasets.load_dataset(str(folder), split=hs.split, cache_dir=cache)
        except Exception as exc:
            raise DataError(
                f"{hs.name}: cannot read the local copy {folder}: {str(exc).splitlines()[0][:300]}"
            ) from None
        yield ds


def _collect(hs: HubSet, ds, config: str | None) -> Rows:
    """The split's rows as dicts (each tagged with its config for a every-config set), repeats
    of `hs.unique`'s key dropped as they stream by."""
    seen: set[str] = set()
    out: Rows = []
    for r in ds:
        if hs.unique is not None:
            key = hs.unique(r)
            if key in seen:
                continue
            seen.add(key)
        out.append({**r, "config": config} if hs.config == "*" else dict(r))
    return out


def _hub_rows(hs: HubSet, revision: str) -> Rows:
    if hs.github:
        import urllib.request

        rows: Rows = []
        for f in hs.files:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / Path(f).name
                url = GITHUB_RAW.format(repo=hs.repo, ref=revision, path=f)
                urllib.request.urlretrieve(url, path)  # a fixed https URL
                rows += _file_rows(hs, f, path)
        return rows
    if hs.files:
        from huggingface_hub import hf_hub_download

        return [
            r
            for f in hs.files
            for r in _file_rows(hs, f, Path(hf_hub_download(hs.repo, f, repo_type="dataset", revision=revision)))
        ]
    datasets = _datasets()
    configs = datasets.get_dataset_config_names(hs.repo, revision=revision) if hs.config == "*" else [hs.config]
    rows = []
    for config in configs:
        ds = datasets.load_dataset(hs.repo, config, split=hs.split, revision=revision)
        rows += _collect(hs, ds, config)
    return rows


def _file_rows(hs: HubSet, name: str, path: Path) -> Rows:
    """A raw file's rows (JSON array or JSON lines); each tagged with the file it came from."""
    if not path.is_file():
        raise DataError(f"{hs.name}: {path} not found")
    text = path.read_text(encoding="utf-8")
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.split("\n") if line.strip()]
    except json.JSONDecodeError as exc:
        raise DataError(f"{hs.name}: {path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    return [{**r, "_file": name} for r in rows]


def fetch(hs: HubSet, local_root: Path | None) -> tuple[Rows, dict[str, Any]]:
    """(raw rows, manifest source) from the hub at its current revision (GitHub files at their
    pinned commit, a wheel's files at its pinned version), or from a local copy."""
    if hs.package is not None:
        return _package_rows(hs)
    if local_root is not None:
        rows = _local_rows(hs, local_root)
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
        return rows, {
            "hub_id": hs.repo,
            "config": hs.config,
            "split": hs.split,
            "revision": f"local copy (rows sha256 {digest[:16]})",
        }
    try:
        revision = _revision(hs)
        rows = _hub_rows(hs, revision)
    except (DataError, UserError):
        raise
    except Exception as exc:
        raise _hub_error(hs, exc) from None
    return rows, {"hub_id": hs.repo, "config": hs.config, "split": hs.split, "revision": revision}


# ----------------------------------------------------------------------------- prepare


def _check_columns(hs: HubSet, rows: Rows) -> None:
    if not rows:
        raise DataError(f"{hs.name}: {hs.repo} split {hs.split!r} is empty")
    missing = [c for c in hs.columns if c not in rows[0]]
    if missing:
        raise DataError(
            f"{hs.name}: {hs.repo} has no column(s) {', '.join(missing)} "
            f"(has {', '.join(sorted(rows[0]))}); the hub table needs updating"
        )


def _loadable(rows: Rows, schema: str | None) -> tuple[Rows, list[str]]:
    """Rows the schema's converter accepts, and the others named with the reason."""
    from megatron_sdpo.data.loaders import SCHEMAS, RowError
    from megatron_sdpo.data.records import validate_record

    if schema is None or schema == "bfcl_multiple":  # BFCL rows need their answers: checked on write
        return rows, []
    convert = SCHEMAS[schema][1]
    kept, bad = [], []
    for i, row in enumerate(rows):
        try:
            validate_record({**convert(row, i, {"seed": 0}), "split": "check"}, f"row {i}")
        except (RowError, DataError) as exc:
            rid = row.get("id") or row.get("unique_id") or row.get("question_id") or row.get("Record ID") or f"row {i}"
            bad.append(f"{rid}: {str(exc).splitlines()[0][:200]}")
            continue
        kept.append(row)
    return kept, bad


def needed_sets(preset: str) -> tuple[list[HubSet], list[str]]:
    """(sets to fetch, the preset's file names) for every file source of the preset's stages."""
    from megatron_sdpo.config import load_config

    cfg = load_config(preset, [])
    names: list[str] = []
    for domain in dict.fromkeys(s.domain for s in cfg.stages):
        dcfg = cfg.domains[domain]
        for src in [dcfg.train, *dcfg.eval.values()]:
            for path in src.files():
                if Path(path).name not in names:
                    names.append(Path(path).name)
    unknown = [n for n in names if n not in BY_OUTPUT]
    if unknown:
        raise DataError(
            f"preset {preset}: no hub dataset in the table writes {', '.join(unknown)}; "
            f"the table writes {', '.join(sorted(BY_OUTPUT))}"
        )
    if not names:
        raise DataError(f"preset {preset}: every data source is synthetic; nothing to prepare")
    return list(dict.fromkeys(BY_OUTPUT[n] for n in names)), names


def convert_set(hs: HubSet, rows: Rows, source: dict[str, Any]) -> list[DatasetFile]:
    _check_columns(hs, rows)
    if hs.name == "bfcl_v4_multiple":
        questions = [r for r in rows if "possible_answer/" not in r["_file"]]
        answers = [{k: v for k, v in r.items() if k != "_file"} for r in rows if "possible_answer/" in r["_file"]]
        questions = [{k: v for k, v in r.items() if k != "_file"} for r in questions]
        return [
            DatasetFile(hs.outputs[0], hs.schema, questions, source, hs.license, answers=answers, note=hs.split_rule)
        ]
    if hs.files and not hs.github:
        rows = [{k: v for k, v in r.items() if k != "_file"} for r in rows]
    out = []
    for name, (converted, bad) in hs.convert(rows).items():
        kept, refused = _loadable(converted, hs.schema)
        out.append(DatasetFile(name, hs.schema, kept, source, hs.license, bad + refused, note=hs.split_rule))
    return out


def _files_digest(folder: Path) -> str:
    """sha256 of a local copy's files (paths and bytes, read in blocks)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _prepare_streamed(hs: HubSet, local_root: Path | None, out: Path, command: str, extra: dict) -> dict:
    """A set too large to hold (dolci_set): `datasets` keeps the split on disk and the rows
    are read one at a time, from the hub at its current revision or from a local copy."""
    datasets = _datasets()

    def write(ds: Any, source: dict[str, Any], from_hub: bool) -> dict:
        outputs = (hs.outputs[0], hs.outputs[1])
        return dolci_set.prepare(
            ds,
            source,
            outputs=outputs,
            license=hs.license,
            note=hs.split_rule,
            out=out,
            command=command,
            extra=extra,
            from_hub=from_hub,
        )

    if local_root is not None:
        folder = local_root / hs.repo
        if not folder.is_dir():
            raise DataError(f"{hs.name}: no local copy of {hs.repo} under {local_root}")
        source = {
            "hub_id": hs.repo,
            "config": hs.config,
            "split": hs.split,
            "revision": f"local copy (files sha256 {_files_digest(folder)[:16]})",
        }
        with _local_split(datasets, hs, folder) as ds:
            return write(ds, source, False)
    try:
        revision = _revision(hs)
        ds = datasets.load_dataset(hs.repo, split=hs.split, revision=revision)
    except Exception as exc:
        raise _hub_error(hs, exc) from None
    source = {"hub_id": hs.repo, "config": hs.config, "split": hs.split, "revision": revision}
    return write(ds, source, True)


def prepare(preset: str, out: Path, *, local_root: Path | None = None, only: list[str] | None = None) -> dict[str, Any]:
    """`megatron-sdpo data prepare PRESET --out DIR`: fetch, convert and write each set in turn.

    Each set's files and manifest entries are written as it completes (the manifest keeps what
    an earlier prepare into `out` wrote); a set that fails (network, gated, no rows) is recorded
    under "failed" with one line and the others go on. `only`: these sets (by name) alone, e.g.
    to retry one. Returns the manifest."""
    from megatron_sdpo.data.dataset_files import write_files

    sets, _ = needed_sets(preset)
    if only:
        unknown = [n for n in only if n not in {hs.name for hs in sets}]
        if unknown:
            raise DataError(
                f"--only {', '.join(unknown)}: not a set preset {preset} reads; "
                f"it reads {', '.join(hs.name for hs in sets)}"
            )
        sets = [hs for hs in sets if hs.name in only]
    extra = {"preset": preset, "table_verified": VERIFIED}
    failed: dict[str, str] = {}
    manifest: dict[str, Any] = {}
    for hs in sets:
        try:
            if hs.streamed:
                manifest = _prepare_streamed(hs, local_root, out, f"megatron-sdpo data prepare {preset}", extra)
                continue
            rows, source = fetch(hs, local_root)
            files = convert_set(hs, rows, source)
            manifest = write_files(out, files, command=f"megatron-sdpo data prepare {preset}", extra=extra, merge=True)
        except (DataError, UserError) as exc:
            failed[hs.name] = str(exc).splitlines()[0]
    if failed or not manifest:
        manifest = write_files(out, [], command=f"megatron-sdpo data prepare {preset}", extra=extra, merge=True)
    manifest["failed"] = failed
    return manifest
