"""Dolci-Think-RL's code set as `data prepare` writes it: streamed, split by prompt, checked.

Its split holds 102,014 rows, of which the code rows (`dataset[0]` "code" or "code_stdio") are
21,385; one row can be several MB (KlearReasoner tests), and the other columns hold rollouts and
token ids. So no whole-set list of rows is built: `datasets` keeps the split on disk (Arrow,
memory-mapped) and two passes read it one row at a time.

1. The split key of every code row (sha256 of its prompt with "user: " dropped, whitespace
   collapsed and case folded: dataset_files.question_key) and the counts of the checks below.
   The set of keys is all that is held.
2. Each code row converted (dolci_rows: the tests decoded, read as dataset[0] says, capped) and
   appended to the train or the test file by its key; a refused row is counted by reason, and
   named (the first LISTED_UNCONVERTED of them).

The split: the distinct keys sorted, shuffled with random.Random(42), the first 10% (rounded, at
least one) to test. Rows of one key (a prompt repeated with other tests) go to one side; the
older rule shuffled rows, which could put a duplicate on both.

What a first real fetch checks (printed, and in the manifest under the train file's "checks"):
rows per dataset[0] and per original_dataset, the encodings of the ground truth, the rows
refused by reason and those the caps changed, the revision; one warning line for each count that
departs from the expected ones (EXPECTED). A hub fetch with no warning counts as the check of
this set's hub id and columns.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_sdpo.data import dolci_rows
from megatron_sdpo.data.code_tests import Unconvertible
from megatron_sdpo.data.dataset_files import LISTED_UNCONVERTED, StreamedFile, question_key, write_streamed

EXPECTED = {dolci_rows.CODE: 12_113, dolci_rows.CODE_STDIO: 9_272}
EXPECTED_CODE_ROWS = 21_385
# What is written of a row: the columns the loader reads and the provenance. `outputs` and
# `passrate` are rollouts of the set's filtering run (not references), the token ids another
# tokenizer's: left out.
KEPT = ("id", "custom_id", "prompt", "dataset", "ground_truth", "original_dataset", "dataset_source")
TEST_FRACTION, SEED = 0.1, 42


def split_key(row: dict) -> str:
    prompt = row.get("prompt")
    text = dolci_rows.prompt_text(prompt) if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.sha256(question_key(text).encode("utf-8")).hexdigest()


def test_keys(keys: Iterable[str]) -> set[str]:
    order = sorted(set(keys))
    random.Random(SEED).shuffle(order)
    n_test = max(1, round(len(order) * TEST_FRACTION)) if len(order) > 1 else 0
    return set(order[:n_test])


def reason_kind(reason: str) -> str:
    """A refusal's reason without its details (what the manifest counts rows by)."""
    return re.split(r" \(|: ", reason, maxsplit=1)[0]


def convert_row(row: dict, decoded: Any, revision: str | None) -> tuple[dict, int, int]:
    """(the row as written, tests dropped for an output over the sandbox's cap, tests dropped
    for the byte cap) from the row and its decoded tests; Unconvertible with the reason."""
    from megatron_sdpo.data.loaders import SCHEMAS, RowError
    from megatron_sdpo.data.records import validate_record
    from megatron_sdpo.errors import DataError

    kept, over_output, over_bytes = dolci_rows.capped(dolci_rows.cases(row, decoded))
    if not kept:
        raise Unconvertible(
            f"no test within the caps (an output over {dolci_rows.MAX_OUTPUT_CHARS} characters, "
            f"or a first test over {dolci_rows.MAX_TESTS_BYTES} bytes)"
        )
    out = {key: row.get(key) for key in KEPT}
    out["ground_truth"] = [json.dumps(dolci_rows.hub_form(kept), ensure_ascii=False)]
    if revision is not None:
        out["hub_revision"] = revision
    try:  # what the loader will make of it: refused here, with its reason, rather than there
        validate_record({**SCHEMAS["dolci_code"][1](out, 0, {"seed": 0}), "split": "check"}, "row")
    except (RowError, DataError) as exc:
        raise Unconvertible(str(exc).splitlines()[0][:200]) from None
    return out, over_output, over_bytes


class Tally:
    """The counts a fetch is checked by, and the refused rows (named up to LISTED_UNCONVERTED)."""

    def __init__(self) -> None:
        self.rows = 0
        self.labels: Counter[str] = Counter()
        self.origins: Counter[str] = Counter()
        self.encodings: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.named: list[str] = []
        self.over_output = self.over_bytes = 0  # rows the caps changed

    def first_pass(self, row: dict) -> bool:
        """Count the row; True for a code row."""
        self.rows += 1
        self.labels[str(dolci_rows.label(row))] += 1
        if not dolci_rows.is_code(row):
            return False
        self.origins[str(row.get("original_dataset"))] += 1
        return True

    def refuse(self, row: dict, reason: str) -> None:
        self.refused[reason_kind(reason)] += 1
        if len(self.named) < LISTED_UNCONVERTED:
            self.named.append(f"{row.get('id') or row.get('custom_id') or '?'}: {reason}")

    def checks(self, revision: str, n_keys: int, n_test_keys: int, from_hub: bool, columns: list[str]) -> dict:
        code = sum(self.labels[label] for label in dolci_rows.CODE_LABELS)
        warnings = [
            f"{label} rows: {self.labels[label]:,}, expected {want:,}"
            for label, want in EXPECTED.items()
            if self.labels[label] != want
        ]
        if code != EXPECTED_CODE_ROWS:
            warnings.append(f"code rows in all: {code:,}, expected {EXPECTED_CODE_ROWS:,}")
        return {
            "revision": revision,
            "rows": self.rows,
            "code_rows": code,
            "columns": columns,
            "by_dataset": dict(self.labels.most_common()),
            "by_original_dataset": dict(self.origins.most_common()),
            "encodings": dict(self.encodings.most_common()),
            "refused": dict(self.refused.most_common()),
            "capped": {
                "rows_with_outputs_over_the_sandbox_cap": self.over_output,
                "rows_over_the_byte_cap": self.over_bytes,
                "output_chars": dolci_rows.MAX_OUTPUT_CHARS,
                "bytes_per_row": dolci_rows.MAX_TESTS_BYTES,
            },
            "split": {"distinct_prompts": n_keys, "test_prompts": n_test_keys, "duplicate_rows": code - n_keys},
            "expected": {**EXPECTED, "code_rows": EXPECTED_CODE_ROWS},
            "warnings": warnings,
            "verified": from_hub and not warnings,
        }


def converted(rows: Iterable[dict], tests: set[str], tally: Tally, revision: str | None) -> Iterator[tuple[bool, dict]]:
    """(to the test side, the row as written) for each code row that converts; the others
    counted in `tally`."""
    for row in rows:
        if not dolci_rows.is_code(row):
            continue
        try:
            decoded, encoding = dolci_rows.tests_of(row.get("ground_truth"), packed=True)
            tally.encodings[encoding] += 1  # of every code row whose tests could be read
            out, over_output, over_bytes = convert_row(row, decoded, revision)
        except Unconvertible as exc:
            tally.refuse(row, str(exc))
            continue
        tally.over_output += over_output > 0
        tally.over_bytes += over_bytes > 0
        yield split_key(row) in tests, out


def prepare(
    ds: Any,
    source: dict[str, Any],
    *,
    outputs: tuple[str, str],
    license: str,
    note: str,
    out: Path,
    command: str,
    extra: dict,
    from_hub: bool,
) -> dict:
    """Write the train and test files of `ds` (a `datasets` split) under `out`, one row at a
    time, and their manifest entries; returns the manifest."""
    columns = list(ds.column_names)
    missing = [c for c in KEPT if c not in columns]
    if missing:
        from megatron_sdpo.errors import DataError

        raise DataError(
            f"dolci_code: {source.get('hub_id')} has no column(s) {', '.join(missing)} "
            f"(has {', '.join(sorted(columns))}); the hub table needs updating"
        )
    tally = Tally()
    keys = {split_key(r) for r in ds.select_columns(["prompt", "dataset", "original_dataset"]) if tally.first_pass(r)}
    tests = test_keys(keys)
    partial = [out / f".{Path(name).stem}.partial.jsonl" for name in outputs]
    out.mkdir(parents=True, exist_ok=True)
    counts = [0, 0]
    try:
        with partial[0].open("w", encoding="utf-8") as train, partial[1].open("w", encoding="utf-8") as test:
            for to_test, row in converted(ds.select_columns(list(KEPT)), tests, tally, str(source["revision"])):
                (test if to_test else train).write(json.dumps(row, ensure_ascii=True) + "\n")
                counts[to_test] += 1
        checks = tally.checks(str(source["revision"]), len(keys), len(tests), from_hub, columns)
        refused = sum(tally.refused.values())
        files = [
            StreamedFile(
                name,
                "dolci_code",
                path,
                n,
                source,
                license,
                note=note,
                unconverted=tally.named if i == 0 else [],
                unconverted_count=refused if i == 0 else 0,
                checks=checks if i == 0 else None,
            )
            for i, (name, path, n) in enumerate(zip(outputs, partial, counts, strict=True))
        ]
        return write_streamed(out, files, command=command, extra=extra)
    finally:  # a failed set leaves nothing half written (a file checked and renamed is gone from here)
        for path in partial:
            path.unlink(missing_ok=True)
