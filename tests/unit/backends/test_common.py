"""The helpers both backends share (backends/common.py)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_sdpo.backends import common
from megatron_sdpo.backends.common import MetricSums, checked_batch, dp_sizes, dp_slice, named_model, reduce_metrics
from megatron_sdpo.errors import ConfigError, DataError
from megatron_sdpo.interfaces.backend import SequenceBatch


def test_dp_slices_cover_the_batch_in_order():
    assert [dp_slice(5, 2, r) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert dp_sizes(7, 3) == [3, 2, 2]
    for n, world in [(4, 4), (7, 3), (9, 2), (1, 1)]:
        assert sum((dp_slice(n, world, r) for r in range(world)), []) == list(range(n))
    with pytest.raises(DataError, match="smaller than the data-parallel size 2"):
        dp_slice(1, 2, 0)


def test_pad_id_prefers_the_caller_then_pad_then_eos():
    resolve_pad_id = common.resolve_pad_id
    cfg = SimpleNamespace(pad_token_id=None, eos_token_id=[5, 6])
    assert resolve_pad_id(3, cfg) == 3
    assert resolve_pad_id(None, cfg) == 5  # the first of several eos ids
    assert resolve_pad_id(None, SimpleNamespace(pad_token_id=2, eos_token_id=5)) == 2
    assert resolve_pad_id(None, SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0


def test_named_model_names_what_is_missing():
    models = {"policy": "P", "teacher": None, "reference": "R"}
    assert named_model("policy", models) == "P" and named_model("reference", models) == "R"
    with pytest.raises(ConfigError, match="without a teacher model .with_teacher=False"):
        named_model("teacher", models)
    with pytest.raises(ConfigError, match="got 'critic'"):
        named_model("critic", models)


def test_checked_batch_adds_the_mask_and_rejects_empty_responses():
    batch, T = checked_batch(SequenceBatch([[1], [2]], [[3, 4], [5]]))
    assert T == 2 and batch.tensors["response_mask"].tolist() == [[1.0, 1.0], [1.0, 0.0]]
    with pytest.raises(DataError, match="every response in the batch is empty"):
        checked_batch(SequenceBatch([[1], [2]], [[], []]))


def test_metric_sums_combine_by_name_and_reduce_locally():
    sums = MetricSums()
    sums.add_all(
        torch.tensor(0.5), {"g/x": torch.tensor(1.0), "g/r_max": torch.tensor(2.0), "g/r_min": torch.tensor(2.0)}
    )
    sums.add_all(
        torch.tensor(0.25), {"g/x": torch.tensor(3.0), "g/r_max": torch.tensor(-1.0), "g/r_min": torch.tensor(-1.0)}
    )
    out = reduce_metrics(sums, sorted(sums.values))
    assert out == {"g/x": 4.0, "loss": 0.75, "g/r_max": 2.0, "g/r_min": -1.0}
    assert all(v.dtype == torch.float32 for v in sums.values.values())
    # A rank without shares contributes each reduction's identity.
    assert reduce_metrics(None, ["loss", "a_max", "a_min"], "cpu") == {
        "loss": 0.0,
        "a_max": float("-inf"),
        "a_min": float("inf"),
    }
