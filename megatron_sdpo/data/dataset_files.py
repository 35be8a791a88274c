"""Converted benchmark files and their manifest (what `megatron-sdpo data local | prepare` write).

Each `DatasetFile` is written as JSONL (or parquet, by its name), then read back with the
project's own loader in its schema: a row the loader refuses makes the command fail, so a
written file is known to load. manifest.json records, per file: the schema, the row count, the
sha256 of the bytes written, where the rows came from (package and version, or hub id and
revision) with the licence, and the items that could not be converted, each named with its reason.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sdpo.errors import DataError

MANIFEST = "manifest.json"
# Unconverted items listed by name in the manifest; the count is always complete.
LISTED_UNCONVERTED = 200


@dataclass
class DatasetFile:
    name: str  # path relative to the output directory, e.g. "math500.jsonl"
    schema: str | None  # the loader schema (megatron_sdpo.data.loaders.SCHEMAS); None: no loader
    rows: list[dict]
    source: dict[str, Any]  # {"package", "version", "path"} or {"hub_id", "config", "split", "revision"}
    license: str
    unconverted: list[str] = field(default_factory=list)  # "item id: reason"
    answers: list[dict] | None = None  # BFCL: the possible_answer rows, written beside the file
    note: str = ""


def _dump_jsonl(path: Path, rows: list[dict]) -> None:
    # ensure_ascii keeps every line free of U+2028 / U+0085, which some JSONL readers split on.
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def _dump(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        _dump_jsonl(path, rows)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_loads(path: Path, item: DatasetFile, answers: Path | None = None) -> int:
    """Rows of the written file that the loader reads in the item's schema (all, or DataError)."""
    from megatron_sdpo.data.loaders import load_records

    if item.schema is None:
        return len(item.rows)
    records = load_records(path, item.schema, answers_path=answers)
    if len(records) != len(item.rows):
        raise DataError(f"{path}: wrote {len(item.rows)} rows but the {item.schema} loader read {len(records)}")
    return len(records)


@dataclass
class StreamedFile:
    """A JSONL file already written, row by row, into a hidden sibling `partial` of its place
    (a set too large to hold: dolci_set); checked line by line, then renamed into place."""

    name: str
    schema: str
    partial: Path
    rows: int
    source: dict[str, Any]
    license: str
    unconverted: list[str] = field(default_factory=list)  # the first LISTED_UNCONVERTED named
    unconverted_count: int = 0
    note: str = ""
    checks: dict[str, Any] | None = None  # what a first real fetch checks (summary_lines prints it)


def _check_streamed(path: Path, schema: str) -> int:
    """Rows of a written JSONL file the loader's converter accepts, read one line at a time (the
    loader itself reads a file whole); DataError naming the first it refuses."""
    from megatron_sdpo.data.loaders import SCHEMAS, RowError
    from megatron_sdpo.data.records import validate_record

    convert, count = SCHEMAS[schema][1], 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                validate_record({**convert(json.loads(line), lineno, {"seed": 0}), "split": "check"}, "row")
            except (ValueError, RowError, DataError) as exc:
                raise DataError(f"{path}:{lineno}: {str(exc).splitlines()[0][:200]}") from None
            count += 1
    return count


def write_streamed(out: Path, items: list[StreamedFile], *, command: str, extra: dict | None = None) -> dict:
    """Check and rename streamed files into place and add their entries to `out`/manifest.json
    (the entries of other files kept); return the manifest."""
    files: dict[str, Any] = dict(read_manifest(out).get("files", {}))
    for item in items:
        if item.rows == 0:
            raise DataError(f"{item.name}: no rows converted ({item.unconverted_count} unconvertible)")
        rows = _check_streamed(item.partial, item.schema)
        if rows != item.rows:
            raise DataError(f"{item.partial}: wrote {item.rows} rows but the {item.schema} loader read {rows}")
        path = out / item.name
        item.partial.replace(path)
        entry = _entry(
            path, item.schema, rows, item.source, item.license, item.unconverted, item.unconverted_count, item.note
        )
        if item.checks is not None:
            entry["checks"] = item.checks
        files[item.name] = entry
    return _write_manifest(out, files, command, extra)


def _entry(
    path: Path, schema: str | None, rows: int, source: dict, license: str, unconverted: list[str], count: int, note: str
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "schema": schema,
        "rows": rows,
        "sha256": sha256_of(path),
        "source": source,
        "license": license,
        "unconverted": {"count": count, "items": unconverted[:LISTED_UNCONVERTED]},
    }
    if note:
        entry["note"] = note
    return entry


def _write_manifest(out: Path, files: dict[str, Any], command: str, extra: dict | None) -> dict:
    manifest = {
        "command": command,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
        "files": files,
    }
    tmp_manifest = out / f".{MANIFEST}.partial"
    tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp_manifest.replace(out / MANIFEST)
    return manifest


def _write_atomic(path: Path, rows: list[dict]) -> Path:
    """Rows into a hidden sibling of `path` (same suffix, so the loader reads it); the caller
    renames it into place once checked."""
    tmp = path.with_name(f".{path.stem}.partial{path.suffix}")
    _dump(tmp, rows)
    return tmp


def write_files(
    out: Path, items: list[DatasetFile], *, command: str, extra: dict | None = None, merge: bool = False
) -> dict:
    """Write `items` under `out` and `out`/manifest.json; return the manifest. Every file is
    written beside its place, checked with its loader and renamed into place; the manifest is
    replaced last. merge: keep the entries of files an earlier manifest in `out` lists."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"output directory {out} is not writable: {exc.strerror}") from None
    names = [i.name for i in items]
    if len(set(names)) != len(names):
        raise DataError(f"two datasets write the same file: {sorted(n for n in names if names.count(n) > 1)}")
    for item in items:
        if not item.rows:
            raise DataError(f"{item.name}: no rows converted ({len(item.unconverted)} unconvertible)")
    files: dict[str, Any] = dict(read_manifest(out).get("files", {})) if merge else {}
    for item in items:
        path = out / item.name
        answers_path = None
        if item.answers is not None:
            answers_path = path.parent / "possible_answer" / path.name
            _write_atomic(answers_path, item.answers).replace(answers_path)
        tmp = _write_atomic(path, item.rows)
        rows = _check_loads(tmp, item, answers_path)
        tmp.replace(path)
        entry = _entry(
            path, item.schema, rows, item.source, item.license, item.unconverted, len(item.unconverted), item.note
        )
        if item.answers is not None:
            rel = str(Path(item.name).parent / "possible_answer" / Path(item.name).name)
            entry["possible_answer"] = {"file": rel, "sha256": sha256_of(out / rel)}
        files[item.name] = entry
    return _write_manifest(out, files, command, extra)


def read_manifest(out: Path) -> dict:
    """The manifest an earlier command wrote into `out` ({} when none, or unreadable)."""
    try:
        data = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def summary_lines(manifest: dict) -> list[str]:
    """One line per written file: name, rows, schema, unconverted count; then a file's checks
    (a set checked on its first real fetch) and one `warning:` line for each departure."""
    lines = []
    for name, f in manifest["files"].items():
        skipped = f["unconverted"]["count"]
        lines.append(
            f"{name}: {f['rows']} rows ({f['schema'] or 'no loader'})"
            + (f", {skipped} not convertible" if skipped else "")
        )
        lines += _check_lines(name, f.get("checks"))
    return lines


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {n:,}" for key, n in counts.items()) or "none"


def _check_lines(name: str, checks: dict | None) -> list[str]:
    if not checks:
        return []
    capped = checks["capped"]
    return [
        f"  {name} checks: revision {checks['revision']}; {checks['code_rows']:,} code rows of {checks['rows']:,}",
        f"  by dataset[0]: {_counts(checks['by_dataset'])}",
        f"  by original_dataset: {_counts(checks['by_original_dataset'])}",
        f"  encodings: {_counts(checks['encodings'])}",
        f"  refused: {_counts(checks['refused'])}",
        f"  capped: {capped['rows_with_outputs_over_the_sandbox_cap']:,} rows lost tests with an output over "
        f"{capped['output_chars']:,} characters, {capped['rows_over_the_byte_cap']:,} rows tests past "
        f"{capped['bytes_per_row']:,} bytes",
        f"  split: {checks['split']['distinct_prompts']:,} distinct prompts ({checks['split']['test_prompts']:,} to "
        f"test), {checks['split']['duplicate_rows']:,} rows repeat a prompt",
    ] + [f"warning: {name}: {w}" for w in checks["warnings"]]


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces matched), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip() or None
                j += 1
            return None  # unbalanced
        start = text.rfind("\\boxed", 0, start)
    return None


def question_key(text: str) -> str:
    """A question's identity across sets: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def hold_out(item: DatasetFile, held: list[DatasetFile], field: str) -> None:
    """Drop from `item` (a training pool) the rows whose question (`field`) also stands in one of
    the `held` evaluation files, so that no source question is on both sides; each is named."""
    keys: dict[str, str] = {}
    for h in held:
        keys.update({question_key(str(r[field])): h.name for r in h.rows})
    kept = []
    for row in item.rows:
        where = keys.get(question_key(str(row[field])))
        if where is None:
            kept.append(row)
        else:
            item.unconverted.append(f"{row['id']}: held out, its question is also in {where}")
    item.rows = kept
