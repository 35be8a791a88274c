"""OOD distance by data: hand-computed RBF-MMD, the distance table, and the tercile grouping."""

import json
import math

import pytest
import torch

from megatron_sdpo.diagnostics.forgetting import EvalMatrix
from megatron_sdpo.diagnostics.ood_distance import (
    OOD_DISTANCE_FILE,
    dataset_distance,
    distance_table,
    ood_change_by_distance,
    read_distance_table,
    write_distance_table,
)
from megatron_sdpo.errors import DataError


class LengthEmbedder:
    """1-D embedding: the text's length, so kernel sums can be written out by hand."""

    def __init__(self):
        self.calls = 0

    def encode(self, texts):
        self.calls += 1
        return torch.tensor([[float(len(t))] for t in texts])


E = math.exp


def test_mmd_of_two_1d_sets_written_out():
    # x = {0, 1}, y = {2}, s = 1: k(u, v) = exp(-(u - v)^2 / 2).
    # mean k(x, x) = (1 + e^-1/2 + e^-1/2 + 1) / 4; mean k(y, y) = 1;
    # mean k(x, y) = (e^-2 + e^-1/2) / 2.
    kxx = (2 + 2 * E(-0.5)) / 4
    kxy = (E(-2.0) + E(-0.5)) / 2
    want = math.sqrt(kxx + 1.0 - 2 * kxy)  # = sqrt(1.5 - e^-1/2 / 2 - e^-2) = 1.030242...
    got = dataset_distance(torch.tensor([[0.0], [1.0]]), torch.tensor([[2.0]]), bandwidth=1.0)
    assert got == pytest.approx(want, rel=1e-12)
    assert got == pytest.approx(1.030242, abs=1e-6)


def test_mmd_of_two_2d_sets_written_out():
    # x = {(0,0), (3,4)}: |x1 - x2|^2 = 25; y = {(0,0)}; s = 5 so 25 / (2 s^2) = 1/2.
    # mean k(x,x) = (2 + 2 e^-1/2) / 4, k(y,y) = 1, mean k(x,y) = (1 + e^-1/2) / 2
    # MMD^2 = (1 - e^-1/2) / 2.
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    y = torch.tensor([[0.0, 0.0]])
    assert dataset_distance(x, y, bandwidth=5.0) == pytest.approx(math.sqrt((1 - E(-0.5)) / 2), rel=1e-12)
    assert dataset_distance(x, x.clone(), bandwidth=5.0) == 0.0


def test_distance_table_uses_one_pooled_bandwidth():
    # Embedded points (lengths): math train {1, 2}; math/ood_near {1, 2}; code/ood_far {3}.
    # Nonzero pairwise distances of the pool {1, 2, 1, 2, 3}: 1 x6, 2 x2 -> median (lower) 1.
    emb = LengthEmbedder()
    table = distance_table({"math": ["a", "bb"]}, {"math/ood_near": ["a", "bb"], "code/ood_far": ["ccc"]}, emb)
    assert table["bandwidth"] == 1.0 and emb.calls == 1  # every set embedded in one call
    d = table["distances"]["math"]
    assert d["math/ood_near"] == 0.0
    # x = {1, 2}, y = {3}: the 1-D case above shifted by one.
    assert d["code/ood_far"] == pytest.approx(math.sqrt(1.5 - E(-0.5) / 2 - E(-2.0)), rel=1e-12)
    with pytest.raises(DataError, match="no prompts"):
        distance_table({"math": []}, {"math/id": ["a"]}, emb)


def test_distance_table_samples_at_most_n_prompts_deterministically():
    prompts = ["x" * i for i in range(1, 40)]
    a = distance_table({"m": prompts}, {"m/ood_far": prompts[::-1]}, LengthEmbedder(), n=8, seed=3)
    b = distance_table({"m": prompts}, {"m/ood_far": prompts[::-1]}, LengthEmbedder(), n=8, seed=3)
    assert a == b and a["n"] == 8


def _matrix():
    cols = ["math/id", "math/ood_near", "code/id", "code/ood_far"]
    vals = {
        "base": {"math/id": 0.2, "math/ood_near": 0.5, "code/id": 0.1, "code/ood_far": 0.4},
        "math": {"math/id": 0.6, "math/ood_near": 0.6, "code/id": 0.1, "code/ood_far": 0.3},
        "code": {"math/id": 0.5, "math/ood_near": 0.55, "code/id": 0.4, "code/ood_far": 0.45},
    }
    return EvalMatrix(["base", "math", "code"], cols, vals)


def test_ood_change_grouped_by_distance_terciles():
    table = {
        "distances": {
            "math": {"math/ood_near": 0.1, "code/ood_far": 0.9, "math/id": 0.0},
            "code": {"math/ood_near": 0.5, "code/ood_far": 0.2},
        }
    }
    got = ood_change_by_distance(_matrix(), table)
    # Pairs by distance: (1 math/ood_near .1), (2 code/ood_far .2), (2 math/ood_near .5), (1 code/ood_far .9);
    # in-domain columns are not OOD pairs even with a distance.
    assert [(p["stage"], p["column"]) for p in got["pairs"]] == [
        (1, "math/ood_near"),
        (2, "code/ood_far"),
        (2, "math/ood_near"),
        (1, "code/ood_far"),
    ]
    in_stage = [0.6 - 0.5, 0.45 - 0.3, 0.55 - 0.6, 0.3 - 0.4]
    from_base = [0.6 - 0.5, 0.45 - 0.4, 0.55 - 0.5, 0.3 - 0.4]
    for p, a, b in zip(got["pairs"], in_stage, from_base, strict=True):
        assert p["in_stage"] == pytest.approx(a) and p["from_base"] == pytest.approx(b)
    g = got["groups"]  # 4 pairs in three groups: 2, 1, 1
    assert (g["near"]["n"], g["mid"]["n"], g["far"]["n"]) == (2, 1, 1)
    assert g["near"]["distance_mean"] == pytest.approx(0.15)
    assert g["near"]["in_stage_mean"] == pytest.approx((0.1 + 0.15) / 2)
    assert g["mid"]["from_base_mean"] == pytest.approx(0.05)
    assert g["far"]["in_stage_mean"] == pytest.approx(-0.1) and g["far"]["pairs"] == ["1:code/ood_far"]
    # OLS slope: mean x .425, mean y .025, Sxx = .3875, Sxy = -.1175.
    assert got["slope_in_stage"] == pytest.approx(-0.1175 / 0.3875)


def test_ood_change_without_distances_is_empty():
    got = ood_change_by_distance(_matrix(), {"distances": {}})
    assert got["pairs"] == [] and got["groups"]["near"]["n"] == 0 and got["slope_in_stage"] is None


def test_table_file_written_once_and_read_back(tmp_path):
    emb = LengthEmbedder()
    path = write_distance_table(tmp_path, {"math": ["a"]}, {"code/ood_far": ["ccc"]}, emb, n=4, seed=0)
    assert path.name == OOD_DISTANCE_FILE and read_distance_table(tmp_path)["distances"]["math"]["code/ood_far"] > 0
    write_distance_table(tmp_path, {"math": ["a"]}, {"code/ood_far": ["ccc"]}, emb, n=4, seed=0)
    assert emb.calls == 1  # kept, not recomputed
    assert read_distance_table(tmp_path / "nowhere") is None
    path.write_text("{not json")
    with pytest.raises(DataError, match="cannot read"):
        read_distance_table(tmp_path)
    path.write_text(json.dumps({"bandwidth": 1.0}))
    with pytest.raises(DataError, match="no 'distances'"):
        read_distance_table(tmp_path)
