"""The paper presets and their table (presets/README.md): every setting a paper preset changes
from `base.yaml` has a row with its source; the arms differ from their model preset only where
the paper's arms differ."""

import dataclasses
import fnmatch
import re

import pytest

from megatron_sdpo.config import load_config
from megatron_sdpo.config.construction import to_dict
from megatron_sdpo.config.presets import PRESET_DIR, list_presets

PAPER = [n for n in list_presets() if n == "paper" or n.startswith(("qwen3_4b", "olmo3_7b"))]
TABLE = (PRESET_DIR / "README.md").read_text()


def _flat(d, prefix=""):
    if isinstance(d, dict) and d:
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: d}


def _rows() -> list[tuple[list[str], str]]:
    """(backticked spans of the row's first two cells, the row's last cell) per table row."""
    rows = []
    for line in TABLE.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or set(cells[0]) <= set("-: "):
            continue
        # Config keys only: preset names such as `*_frozen` in a row's label are not keys.
        spans = [
            s.strip()
            for c in cells[:2]
            for s in re.findall(r"`([^`]+)`", c)
            if re.fullmatch(r"[a-z][\w.*]*", s.strip())
        ]
        rows.append((spans, cells[-1]))
    return rows


def _documented(key: str, rows) -> bool:
    """A row names `key`: a span that is the key, its dotted tail, or a section above it
    (`*` matching any name: `domains.*.eval.ood_*`)."""
    for spans, source in rows:
        if source and any(fnmatch.fnmatchcase(key, pat) for s in spans for pat in (s, "*." + s, s + ".*")):
            return True
    return False


def test_the_table_lists_every_paper_setting_with_a_source():
    assert {
        "paper",
        "qwen3_4b",
        "qwen3_4b_frozen",
        "qwen3_4b_ema5",
        "qwen3_4b_stable",
        "qwen3_4b_grpo",
        "qwen3_4b_frozen_mathfb",
        "olmo3_7b",
        "olmo3_7b_frozen",
        "olmo3_7b_ema5",
        "olmo3_7b_stable",
        "olmo3_7b_grpo",
        "olmo3_7b_frozen_mathfb",
    } <= set(PAPER)
    base = _flat(to_dict(load_config("base")))
    rows = _rows()
    missing = set()
    for name in PAPER:
        for key, value in _flat(to_dict(load_config(name))).items():
            if value != base.get(key, object()) and not _documented(key, rows):
                missing.add(key)
    assert not missing, f"paper-preset settings without a row in presets/README.md: {sorted(missing)}"


def test_every_row_names_its_source():
    for spans, source in _rows():
        assert source, f"a row without a source: {spans}"


def test_the_table_documents_what_the_reference_options_compute():
    # A row of the table per ported option, and each one off in every paper preset.
    for key in ("algorithm.sdpo.mask_ratio", "teacher.init_path", "teacher.init_alpha"):
        assert _documented(key, _rows()), key
    for name in PAPER:
        cfg = load_config(name)
        assert (cfg.algorithm.sdpo.mask_ratio, cfg.teacher.init_path, cfg.teacher.init_alpha) == (0.0, None, 1.0)
        assert cfg.teacher.mode != "trust_region"


@pytest.mark.parametrize("model", ["qwen3_4b", "olmo3_7b"])
def test_the_arms_differ_only_in_their_teacher_or_algorithm(model):
    ref = load_config(model)
    frozen, ema5, stable = (load_config(f"{model}_{arm}") for arm in ("frozen", "ema5", "stable"))
    assert (frozen.algorithm.name, frozen.teacher.mode) == ("sdpo", "frozen")
    assert (ema5.teacher.mode, ema5.teacher.ema_rate, ema5.teacher.reset_at_stage) == ("ema", 0.05, "stage_start")
    assert (stable.algorithm.name, stable.teacher.mode) == ("stable_sdpo", "restart_freeze")
    # gamma matched to the EMA horizon: a restart every 1 / 0.05 = 20 steps in every stage.
    from megatron_sdpo.config.stages import stage_config

    for k, stage in enumerate(stable.stages):
        gamma = stage_config(stable, k).teacher.freeze_fraction
        assert round(gamma * stage.steps) == round(1 / ema5.teacher.ema_rate), (k, gamma, stage.steps)
    for arm in (frozen, ema5, stable):
        same = dataclasses.replace(
            arm,
            name=ref.name,
            teacher=ref.teacher,
            stages=ref.stages,
            algorithm=dataclasses.replace(arm.algorithm, name=ref.algorithm.name),
        )
        assert same == ref
    fb = load_config(f"{model}_frozen_mathfb")
    assert (
        fb.algorithm.sdpo.context.feedback_domains == ["math", "code"]
        and fb.algorithm.sdpo.context.math_feedback == "format"
    )
    assert dataclasses.replace(fb, name=frozen.name, algorithm=frozen.algorithm) == frozen
