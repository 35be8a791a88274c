"""Drift, artifact and forgetting diagnostics between continual-learning stages.

Submodules (import what you need; plotting and embedding models load lazily):
  sources         tensor sources: HF safetensors dirs, state dicts, backend export streams
  spectral        randomized truncated SVD, principal angles
  param_drift     per-matrix drift, per-type / per-layer aggregation, update-mask overlap,
                  principal-weight overlap, norm-only drift for in-stage measurements
  response_drift  embedding cosine / MMD between response sets, excess KL from logprobs
  artifacts       artifact statistics of responses, CollapseMonitor
  token_artifacts artifact rates per token and a scorer's endorsement of artifact tokens
  ood_distance    RBF-MMD between datasets' prompt embeddings, OOD change by that distance
  matched_gain    KL to the base at a matched in-domain gain
  forgetting      eval_matrix.csv -> BWT, forgetting, FWT, OOD by distance
  drift           checkpoint_drift (drift.json + PNGs) and the `drift` command line
  probes          generation on probe prompts for response drift (transformers)
"""

from megatron_sdpo.diagnostics.artifacts import (
    ArtifactConfig,
    CollapseConfig,
    CollapseMonitor,
    artifact_stats,
)
from megatron_sdpo.diagnostics.forgetting import EvalMatrix, forgetting_metrics, read_eval_matrix
from megatron_sdpo.diagnostics.param_drift import parameter_drift, update_mask_overlap
from megatron_sdpo.diagnostics.response_drift import excess_kl, mmd_rbf, response_drift
from megatron_sdpo.diagnostics.sources import iter_tensors

__all__ = [
    "ArtifactConfig",
    "CollapseConfig",
    "CollapseMonitor",
    "EvalMatrix",
    "artifact_stats",
    "excess_kl",
    "forgetting_metrics",
    "iter_tensors",
    "mmd_rbf",
    "parameter_drift",
    "read_eval_matrix",
    "response_drift",
    "update_mask_overlap",
]
