"""Forgetting metrics on a hand-written eval matrix."""

import pytest

from megatron_sdpo.diagnostics.forgetting import forgetting_metrics, read_eval_matrix
from megatron_sdpo.errors import DataError

CSV = """after_stage,math/id,math/ood_near,science/id,science/ood_mid,tooluse/id,tooluse/ood_far,code/id
base,0.10,0.20,0.30,0.40,0.50,0.60,0.05
math,0.60,0.50,0.25,0.30,0.45,0.55,0.10
science,0.50,0.45,0.70,0.35,0.40,0.60,0.15
tooluse,0.40,,0.55,0.20,0.90,0.50,0.20
"""


def _write(tmp_path, text, name="eval_matrix.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_metrics_on_hand_written_matrix(tmp_path):
    m = read_eval_matrix(_write(tmp_path, CSV))
    assert m.rows == ["base", "math", "science", "tooluse"]
    assert m.get("tooluse", "math/ood_near") is None
    got = forgetting_metrics(m)
    assert got["stages"] == ["math", "science", "tooluse"]
    d = got["domains"]
    # math: trained at row 1 (0.60), then 0.50, final 0.40
    assert d["math"]["bwt"] == pytest.approx(0.40 - 0.60)
    assert d["math"]["forgetting"] == pytest.approx(0.60 - 0.40)
    assert d["math"]["fwt"] == pytest.approx(0.0)
    # science: trained at row 2 (0.70), final 0.55; before its stage 0.25 vs base 0.30
    assert d["science"]["bwt"] == pytest.approx(-0.15)
    assert d["science"]["forgetting"] == pytest.approx(0.15)
    assert d["science"]["fwt"] == pytest.approx(0.25 - 0.30)
    # tooluse is the last stage: no BWT / forgetting; fwt = 0.40 - 0.50
    assert d["tooluse"]["bwt"] is None and d["tooluse"]["forgetting"] is None
    assert d["tooluse"]["fwt"] == pytest.approx(-0.10)
    # code was never trained
    assert d["code"]["untrained_transfer"] == pytest.approx(0.15) and d["code"]["fwt"] is None
    assert got["average"]["bwt"] == pytest.approx((-0.20 - 0.15) / 2)
    assert got["average"]["forgetting"] == pytest.approx((0.20 + 0.15) / 2)
    assert got["average"]["fwt"] == pytest.approx((-0.05 - 0.10) / 2)
    assert got["final_avg_id"] == pytest.approx((0.40 + 0.55 + 0.90 + 0.20) / 4)
    assert got["final_avg_all"] == pytest.approx((0.40 + 0.55 + 0.20 + 0.90 + 0.50 + 0.20) / 6)
    # per-column metrics: science/ood_mid trained at row 2 (0.35) -> final 0.20
    assert got["columns"]["science/ood_mid"]["forgetting"] == pytest.approx(0.15)
    # math/ood_near final cell missing -> None, not a crash
    assert got["columns"]["math/ood_near"]["bwt"] is None
    assert got["ood"]["near"]["by_row"]["math"] == pytest.approx(0.50)
    assert got["ood"]["near"]["final_minus_base"] is None
    assert got["ood"]["mid"]["final_minus_base"] == pytest.approx(0.20 - 0.40)
    assert got["ood"]["far"]["by_row"]["science"] == pytest.approx(0.60)


def test_missing_columns_and_base_only(tmp_path):
    got = forgetting_metrics(read_eval_matrix(_write(tmp_path, "after_stage,science/id\nbase,0.3\nmath,0.4\n")))
    assert got["domains"]["science"]["untrained_transfer"] == pytest.approx(0.1)
    assert "math" not in got["domains"] and got["ood"] == {}
    assert got["average"] == {"bwt": None, "forgetting": None, "fwt": None}
    base_only = forgetting_metrics(read_eval_matrix(_write(tmp_path, "after_stage,math/id\nbase,0.3\n", "b.csv")))
    assert base_only["stages"] == [] and base_only["final_avg_id"] == pytest.approx(0.3)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty eval matrix"),
        ("stage,math/id\nbase,0.1\n", "must start with 'after_stage'"),
        ("after_stage,math\nbase,0.1\n", "not '<domain>/<split>'"),
        ("after_stage,math/id\nbase,0.1,0.2\n", ":2: 3 cells, header has 2"),
        ("after_stage,math/id\nbase,abc\n", ":2: column math/id: 'abc' is not a number"),
        ("after_stage,math/id\nmath,0.1\n", "first row must be 'base'"),
        ("after_stage,math/id\nbase,0.1\nmath,0.2\nmath,0.3\n", ":4: duplicate stage row 'math'"),
        ("after_stage,math/id\n", "no rows"),
    ],
)
def test_malformed_csv_raises_data_error(tmp_path, text, match):
    with pytest.raises(DataError, match=match):
        read_eval_matrix(_write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_eval_matrix(tmp_path / "nope.csv")
