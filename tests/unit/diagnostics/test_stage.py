"""Stage diagnostics from explicit inputs (diagnostics/stage.py): no run, backend or model."""

import math

import pytest
import torch
from safetensors.torch import save_file
from test_param_drift import _state
from test_response_drift import CharHistogramEmbedder

from megatron_sdpo.diagnostics.param_drift import parameter_drift, principal_weight_overlap
from megatron_sdpo.diagnostics.stage import ProbeLogprobs, StagePolicies, probe_batches, stage_diagnostics


def _policy(tmp_path, name, scale):
    """An HF-style directory whose weights are the base's plus `scale` times a fixed direction."""
    d = tmp_path / name
    d.mkdir()
    base, step = _state(seed=0), _state(seed=1)
    save_file({k: base[k] + scale * step[k] for k in base}, str(d / "model.safetensors"))
    return d


def _samples(responses):
    return {"math/id": [{"id": str(i), "response": r} for i, r in enumerate(responses)], "math/ood_near": []}


def test_stage_record_from_explicit_inputs(tmp_path):
    base, s1, s2 = (_policy(tmp_path, n, s) for n, s in (("base", 0.0), ("s1", 0.1), ("s2", 0.3)))
    base_samples = _samples(["\\boxed{1}", "\\boxed{2}"])
    cur_samples = _samples(["\\boxed{1}", "\\boxed{\\boxed{3}}"])
    # d = base - policy: 0.5 on the first token, -0.5 on the second, a padding column ignored.
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    probes = {"math/id": ProbeLogprobs(torch.tensor([[-1.0, -2.0, 5.0]]), torch.tensor([[-0.5, -2.5, 0.0]]), mask)}
    kw = dict(svd_rank=2, seed=0, probe_n=1, embedder=CharHistogramEmbedder())

    first = stage_diagnostics(0, "math", "sdpo", StagePolicies(base, base, s1), base_samples, cur_samples, probes, **kw)
    assert (first["stage"], first["domain"], first["algorithm"]) == (1, "math", "sdpo")
    assert first["param_vs_base"] == first["param_vs_prev"] and "mask_overlap_vs_prev_update" not in first
    want = parameter_drift(base, s1, rank=2, seed=0)
    assert first["param_vs_prev"]["summary"] == want["summary"] and "matrices" not in first["param_vs_prev"]
    # Only the in-domain set is measured; drift embeds the first probe_n * 4 pairs.
    assert set(first["responses"]) == {"math/id"}
    assert first["responses"]["math/id"]["drift"]["n"] == 2
    k3 = ((math.expm1(0.5) - 0.5) + (math.expm1(-0.5) + 0.5)) / 2
    assert first["excess_kl"]["math/id"]["kl_k1"] == pytest.approx(0.0, abs=1e-7)
    assert first["excess_kl"]["math/id"]["kl_k3"] == pytest.approx(k3, rel=1e-6)
    assert first["excess_kl_mean_k3"] == first["excess_kl"]["math/id"]["kl_k3"]
    assert first["response_cosine_mean"] == first["responses"]["math/id"]["drift"]["cosine_mean"]

    policies = StagePolicies(base, s1, s2, before_prev=base)
    second = stage_diagnostics(1, "code", "sdpo", policies, base_samples, cur_samples, {}, **{**kw, "embedder": None})
    assert second["param_vs_base"]["summary"] == parameter_drift(base, s2, rank=2, seed=0)["summary"]
    assert second["param_vs_prev"]["summary"] != second["param_vs_base"]["summary"]
    # Both updates move along the same direction: the top-1% masks coincide.
    assert second["mask_overlap_vs_prev_update"]["summary"]["jaccard_pooled"] == pytest.approx(1.0)
    assert "matrices" not in second["mask_overlap_vs_prev_update"]
    # No probes, no embedder: no KL and no response drift, but the artifact rates still.
    assert second["excess_kl"] == {} and second["excess_kl_mean_k3"] is None
    assert second["response_cosine_mean"] is None and "drift" not in second["responses"]["math/id"]
    assert second["responses"]["math/id"]["artifacts"]["n"] == 2


def test_probe_batches_take_the_first_answers_with_a_record():
    from megatron_sdpo.builders import load_tokenizer
    from megatron_sdpo.models.tiny import ensure_tiny_base

    tok = load_tokenizer(ensure_tiny_base())
    answers = [{"id": "a", "response": "12"}, {"id": "gone", "response": "3"}, {"id": "b", "response": ""}]
    cur = {"math/id": answers, "math/ood_far": [{"id": "a", "response": "1"}]}
    sets = {"math/id": [{"id": "a", "prompt": "1+11?"}, {"id": "b", "prompt": "0+0?"}]}
    batches = probe_batches(tok, cur, sets, probe_n=2)
    assert list(batches) == ["math/id"]
    b = batches["math/id"]
    assert len(b) == 1 and b.response_ids == [tok("12", add_special_tokens=False)["input_ids"]]
    everything = probe_batches(tok, cur, sets, probe_n=3)["math/id"]
    assert everything.response_ids[1] == [tok.eos_token_id]  # an empty answer is scored as one eos


def test_stage_record_has_principal_overlap_and_token_artifacts(tmp_path):
    base, s1 = (_policy(tmp_path, n, s) for n, s in (("base", 0.0), ("s1", 0.1)))
    samples = _samples(["\\boxed{1}", "\\boxed{2}"])
    # One probe answer "\boxed{1}\boxed{1}" in four tokens: the second "\boxed" covers tokens 2-3.
    pieces = [["\\boxed", "{1}", "\\box", "ed{1}"]]
    ids = [[10, 11, 12, 13]]
    policy = torch.tensor([[-1.0, -1.0, -0.2, -0.4]])
    base_lp = torch.tensor([[-1.5, -1.5, -3.0, -2.0]])
    probes = {"math/id": ProbeLogprobs(policy, base_lp, torch.ones(1, 4), ids, pieces)}
    kw = dict(svd_rank=2, seed=0, probe_n=1, embedder=None)
    rec = stage_diagnostics(0, "math", "sdpo", StagePolicies(base, base, s1), samples, samples, probes, **kw)
    want = principal_weight_overlap(base, s1, rank=2, top_percent=1.0, seed=0)
    assert rec["principal_overlap"]["summary"] == want["summary"] and "matrices" not in rec["principal_overlap"]
    tok = rec["responses"]["math/id"]["token_artifacts"]
    assert tok["tokens"] == 4 and tok["fmt_boxed_token_rate"] == 0.5 and tok["any_token_rate"] == 0.5
    # the policy endorses the artifact tokens (mean -0.3 vs -1.0), the base does not (-2.5 vs -1.5)
    assert tok["endorsement_policy"]["logprob_gap"] == pytest.approx(0.7)
    assert tok["endorsement_base"]["logprob_gap"] == pytest.approx(-1.0)
    off = stage_diagnostics(
        0, "math", "sdpo", StagePolicies(base, base, s1), samples, samples, {}, principal_overlap=False, **kw
    )
    assert "principal_overlap" not in off and "token_artifacts" not in off["responses"]["math/id"]
