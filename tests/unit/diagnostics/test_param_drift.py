"""Parameter drift on constructed cases with known answers."""

import json
import math
import weakref

import pytest
import torch
from safetensors.torch import save_file

from megatron_sdpo.diagnostics.param_drift import (
    layer_index,
    layer_type,
    mask_overlap_tensors,
    matrix_drift,
    parameter_drift,
    principal_mask,
    principal_overlap_tensors,
    principal_weight_overlap,
    update_mask_overlap,
)
from megatron_sdpo.diagnostics.sources import AlignedTensors, SafetensorsCheckpoint, StreamSource, iter_tensors
from megatron_sdpo.errors import CheckpointError


def _svd_matrix(m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
    s = 3.0 * torch.exp(-torch.arange(n, dtype=torch.float64) / 4.0)
    return u, s, v, (u[:, :n] * s) @ v.T


def _state(seed=0, scale=0.0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(2):
        for name, shape in (
            ("self_attn.q_proj", (24, 16)),
            ("self_attn.o_proj", (16, 24)),
            ("mlp.down_proj", (16, 40)),
        ):
            sd[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(16)
    sd["model.embed_tokens.weight"] = torch.randn(50, 16, generator=g)
    sd["lm_head.weight"] = torch.randn(50, 16, generator=g)
    return sd


def test_layer_names():
    assert layer_type("model.layers.3.self_attn.k_proj.weight") == "k_proj"
    assert layer_index("model.layers.3.self_attn.k_proj.weight") == 3
    assert layer_type("model.layers.0.self_attn.q_norm.weight") == "norm"
    assert layer_type("model.norm.weight") == "norm"
    assert layer_type("model.embed_tokens.weight") == "embed"
    assert layer_type("lm_head.weight") == "lm_head"
    assert layer_index("lm_head.weight") is None
    assert layer_type("decoder.layers.1.self_attention.linear_qkv.weight") == "qkv_proj"
    assert layer_type("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight") == "norm"
    assert layer_type("decoder.layers.1.mlp.linear_fc2.weight") == "down_proj"
    assert layer_index("decoder.layers.12.mlp.linear_fc1.weight") == 12


@pytest.mark.parametrize("exact_max_dim", [1000, 0])  # exact and randomized SVD paths
def test_identical_weights_zero_drift(exact_max_dim):
    sd = _state()
    res = parameter_drift(sd, {k: v.clone() for k, v in sd.items()}, rank=4, spectrum_k=8, exact_max_dim=exact_max_dim)
    assert res["summary"]["n"] == 8  # 3 per layer x 2 + embed + lm_head; norms are vectors
    for rec in res["matrices"]:
        assert rec["rel_frob"] == 0.0 and rec["spectral_shift"] == 0.0
        assert rec["angle_max_deg"] < 1e-3, rec
    assert all(v["rel_frob"] == 0.0 for v in res["vectors"])
    assert res["missing"] == {"a": [], "b": []}


@pytest.mark.parametrize("exact_max_dim", [1000, 0])
def test_pure_rotation_keeps_spectrum_and_gives_known_angle(exact_max_dim):
    m, n, r, theta = 60, 40, 4, math.radians(25.0)
    u, s, _, a = _svd_matrix(m, n)
    # B = R A, R a Givens rotation by theta in the plane (u_1, u_{r+1}): the top-r left
    # subspace turns by theta in one direction; the right subspace and spectrum stay put.
    e1, e2 = u[:, 0:1], u[:, r : r + 1]
    rot = (
        torch.eye(m, dtype=torch.float64)
        + (math.cos(theta) - 1) * (e1 @ e1.T + e2 @ e2.T)
        + math.sin(theta) * (e2 @ e1.T - e1 @ e2.T)
    )
    torch.testing.assert_close(rot.T @ rot, torch.eye(m, dtype=torch.float64))
    b = rot @ a
    got = matrix_drift(a.float(), b.float(), rank=r, spectrum_k=12, exact_max_dim=exact_max_dim)
    assert got["svd"] == ("exact" if exact_max_dim else "randomized")
    assert got["spectral_shift"] < 1e-5
    assert got["angle_left_max_deg"] == pytest.approx(25.0, abs=0.01)
    assert got["angle_left_mean_deg"] == pytest.approx(25.0 / r, abs=0.01)
    assert got["angle_right_max_deg"] < 0.01
    expected_rel = 2 * math.sin(theta / 2) * math.sqrt(s[0] ** 2 + s[r] ** 2) / s.norm().item()
    assert got["rel_frob"] == pytest.approx(expected_rel, rel=1e-5)


def test_scaling_changes_spectrum_not_subspaces():
    _, _, _, a = _svd_matrix(30, 20, seed=2)
    got = matrix_drift(a.float(), 1.5 * a.float(), rank=3, spectrum_k=None)
    assert got["spectral_shift"] == pytest.approx(0.5, rel=1e-5)
    assert got["rel_frob"] == pytest.approx(0.5, rel=1e-5)
    assert got["angle_max_deg"] < 1e-2


def _rank_one_update(base, rows, cols):
    a = torch.zeros(base.shape[0])
    b = torch.zeros(base.shape[1])
    a[rows] = torch.arange(1, len(rows) + 1, dtype=torch.float32)
    b[cols] = torch.arange(1, len(cols) + 1, dtype=torch.float32) * 0.1
    return base + torch.outer(a, b)


def test_rank_one_updates_mask_overlap_as_built(tmp_path):
    torch.manual_seed(0)
    base = torch.randn(100, 40)
    # k = 1% of 4000 = 40 = 5 rows x 8 cols for each update; they share rows {3,4} x cols {4..7}
    x = _rank_one_update(base, list(range(0, 5)), list(range(0, 8)))
    y = _rank_one_update(base, list(range(3, 8)), list(range(4, 12)))
    got = mask_overlap_tensors(base, x, base, y, top_percent=1.0)
    assert (got["k"], got["intersection"], got["union"]) == (40, 8, 72)
    assert got["jaccard"] == pytest.approx(8 / 72)
    assert got["chance"] == pytest.approx(0.01 / 1.99)
    assert mask_overlap_tensors(base, x, base, x)["jaccard"] == 1.0
    assert math.isnan(mask_overlap_tensors(base, base, base, base.clone())["jaccard"])

    # Through checkpoints on disk: three checkpoints (base->x vs base->y), base given twice.
    name = "model.layers.0.mlp.up_proj.weight"
    paths = {}
    for key, w in (("base", base), ("x", x), ("y", y)):
        paths[key] = tmp_path / key
        paths[key].mkdir()
        save_file({name: w.contiguous(), "model.norm.weight": torch.ones(40)}, str(paths[key] / "model.safetensors"))
    res = update_mask_overlap((paths["base"], paths["x"]), (paths["base"], paths["y"]), top_percent=1.0)
    assert res["summary"]["jaccard_pooled"] == pytest.approx(8 / 72)
    assert res["by_type"]["up_proj"]["n"] == 1
    json.dumps(res)
    # Four checkpoints chained: stage update x-base then (x -> x + dy)
    res4 = update_mask_overlap(({name: base}, {name: x}), ({name: x}, {name: x + (y - base)}))
    assert res4["summary"]["jaccard_mean"] == pytest.approx(8 / 72)


def test_pooled_and_per_layer_aggregation():
    a = _state(seed=1)
    b = {k: v.clone() for k, v in a.items()}
    b["model.layers.1.self_attn.q_proj.weight"] += 0.1 * torch.randn(24, 16)
    res = parameter_drift(a, b, rank=2, spectrum_k=4)
    q1 = next(r for r in res["matrices"] if r["name"] == "model.layers.1.self_attn.q_proj.weight")
    assert q1["rel_frob"] > 0
    assert res["by_layer"]["0"]["all"]["rel_frob_pooled"] == 0.0
    assert res["by_layer"]["1"]["q_proj"]["rel_frob_pooled"] == pytest.approx(q1["rel_frob"])
    sq = sum(r["norm_a"] ** 2 for r in res["matrices"])
    assert res["summary"]["rel_frob_pooled"] == pytest.approx(q1["norm_diff"] / math.sqrt(sq))
    assert res["by_type"]["q_proj"]["mean_rel_frob"] == pytest.approx(q1["rel_frob"] / 2)


def _save_sharded(sd, path):
    path.mkdir()
    names = list(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(path / fname))
        weight_map.update({k: fname for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sources_sharded_mapping_and_stream_agree(tmp_path):
    a, b = _state(seed=3), _state(seed=4)
    _save_sharded(a, tmp_path / "a")
    ck = SafetensorsCheckpoint(tmp_path / "a")
    assert sorted(ck.names()) == sorted(a) and ck.shape("lm_head.weight") == (50, 16)
    assert dict((k, v.shape) for k, v in iter_tensors(tmp_path / "a")) == {k: v.shape for k, v in a.items()}
    from_files = parameter_drift(tmp_path / "a", b, rank=2, spectrum_k=4)
    from_stream = parameter_drift(StreamSource(iter(a.items())), iter(b.items()), rank=2, spectrum_k=4)
    assert from_files["summary"] == pytest.approx(from_stream["summary"])


def test_missing_names_reported_and_out_of_step_streams_fail():
    a = _state()
    b = dict(a)
    del b["lm_head.weight"]
    b["extra.weight"] = torch.ones(2, 2)
    res = parameter_drift(a, b, rank=2, spectrum_k=4)
    assert res["missing"] == {"a": ["extra.weight"], "b": ["lm_head.weight"]}
    items = list(a.items())
    with pytest.raises(CheckpointError, match="out of step"):
        list(AlignedTensors([iter(items), iter(items[::-1])]))
    with pytest.raises(CheckpointError, match="ended before the others"):
        list(AlignedTensors([iter(items), iter(items[:-1])]))
    bad = dict(a)
    bad["lm_head.weight"] = torch.ones(51, 16)
    with pytest.raises(CheckpointError, match="lm_head.weight: shape"):
        parameter_drift(a, bad)


def test_streaming_keeps_one_tensor_per_source_alive():
    # A backend export stream: by the time tensor i is produced, tensor i-1 must be freed.
    alive = []

    def stream(seed):
        g = torch.Generator().manual_seed(seed)
        for i in range(6):
            assert sum(ref() is not None for ref in alive) <= 1, "earlier tensors still referenced"
            t = torch.randn(32, 24, generator=g)
            alive.append(weakref.ref(t))
            yield f"model.layers.{i}.mlp.up_proj.weight", t
            del t

    parameter_drift(StreamSource(stream(0)), StreamSource(stream(1)), rank=2, spectrum_k=4)
    assert len(alive) == 12


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        SafetensorsCheckpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        SafetensorsCheckpoint(tmp_path / "empty")
    _save_sharded(_state(), tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="named by the index is missing"):
        SafetensorsCheckpoint(tmp_path / "sharded")
    (tmp_path / "trunc").mkdir()
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "trunc" / "model.safetensors"))
    data = (tmp_path / "trunc" / "model.safetensors").read_bytes()
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt checkpoint shard"):
        SafetensorsCheckpoint(tmp_path / "trunc")


# W = 5 e1 f^T + 4 e2 g^T with f = (.6, .8, 0), g = (0, 0, 1): orthogonal rows, singular values
# 5 and 4, rank-1 reconstruction [[3, 4, 0], [0, 0, 0]]. By raw magnitude the top two entries are
# the two 4s, (0,1) and (1,2); by the rank-1 reconstruction they are (0,1) and (0,0).
_W = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 4.0]])


def test_principal_mask_of_hand_built_matrix():
    top_third = 100.0 / 3.0  # k = round(6 / 3) = 2
    assert principal_mask(_W, rank=1, top_percent=top_third).tolist() == [True, True, False, False, False, False]
    # at full rank the reconstruction is W itself: the two 4s
    assert principal_mask(_W, rank=2, top_percent=top_third).tolist() == [False, True, False, False, False, True]
    with pytest.raises(ValueError):
        principal_mask(_W, rank=1, top_percent=0.0)


def test_principal_overlap_of_hand_built_update():
    delta = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.1, 0.7]])  # top-2 |dW|: (1,2) and (0,0)
    got = principal_overlap_tensors(_W, _W + delta, rank=1, top_percent=100.0 / 3.0)
    # U = {(0,0), (1,2)}, P = {(0,0), (0,1)}: one in common
    assert (got["intersection"], got["update_k"], got["principal_k"]) == (1, 2, 2)
    assert got["share"] == 0.5 and got["jaccard"] == pytest.approx(1 / 3) and got["chance"] == pytest.approx(1 / 3)
    still = principal_overlap_tensors(_W, _W.clone(), rank=1, top_percent=100.0 / 3.0)
    assert still["update_k"] == 0 and math.isnan(still["share"])


def test_principal_weight_overlap_pools_over_matrices():
    delta = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.1, 0.7]])
    a = {
        "model.layers.0.mlp.up_proj.weight": _W,
        "model.layers.0.self_attn.q_proj.weight": _W.clone(),
        "model.layers.0.input_layernorm.weight": torch.ones(3),
    }
    b = {
        "model.layers.0.mlp.up_proj.weight": _W + delta,
        "model.layers.0.self_attn.q_proj.weight": _W.clone(),
        "model.layers.0.input_layernorm.weight": torch.ones(3) * 2,
    }
    got = principal_weight_overlap(a, b, rank=1, top_percent=100.0 / 3.0)
    s = got["summary"]
    # q_proj did not move: it adds nothing to the pooled share, and no NaN to the mean
    assert s["n"] == 2 and s["share_pooled"] == 0.5 and s["share_mean"] == 0.5
    assert s["chance"] == pytest.approx(4 / 12) and s["share_over_chance"] == pytest.approx(1.5)
    assert math.isnan(got["by_type"]["q_proj"]["share_pooled"]) and got["by_type"]["up_proj"]["share_pooled"] == 0.5
    with pytest.raises(CheckpointError):
        principal_weight_overlap({"x.weight": torch.ones(2, 2)}, {"y.weight": torch.ones(2, 2)})


def test_norm_drift_against_two_references_on_a_stream():
    from megatron_sdpo.diagnostics.param_drift import norm_drift

    up, q = "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    base = {up: torch.full((2, 2), 1.0), q: torch.full((2, 2), 2.0), "model.norm.weight": torch.ones(2)}
    start = {up: torch.full((2, 2), 1.0), q: torch.full((2, 2), 3.0), "model.norm.weight": torch.ones(2)}
    now = [(up, torch.full((2, 2), 2.0)), (q, torch.full((2, 2), 3.0)), ("model.norm.weight", torch.ones(2) * 5)]
    got = norm_drift({"stage_start": start, "base": base}, iter(now))
    # vs base: ||dW||^2 = 4 (up) + 4 (q), ||W||^2 = 4 + 16 -> sqrt(8 / 20); norms left out
    assert got["base"]["n"] == 2 and got["base"]["rel_frob_pooled"] == pytest.approx(math.sqrt(8 / 20))
    assert got["base"]["by_type"] == {"q_proj": pytest.approx(0.5), "up_proj": pytest.approx(1.0)}
    # vs stage start: only up moved: sqrt(4 / (4 + 36))
    assert got["stage_start"]["rel_frob_pooled"] == pytest.approx(math.sqrt(4 / 40))
    assert got["stage_start"]["by_type"]["q_proj"] == 0.0
