"""Diagnostics after a stage: how far stage k's policy moved from the previous stage and the base.

Parameters: relative change, spectral shift, principal angles (vs previous, vs base) and the
update-mask overlap of this stage's update with the previous stage's and with the principal
weights of the policy it started from. Responses: embedding similarity and MMD of this stage's
eval answers to the base's on the same prompts, artifact rates (per response and per token), the
excess KL of the policy to the base on its own answers, and how much the policy and the base
endorse the artifact tokens of those answers.

Everything comes in explicitly: checkpoint directories, the eval answers, and the log-probs of
the probe answers under the policy and the base (scored by the caller's backend on the batches
`probe_batches` builds). The continual loop gathers them; report.py writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_sdpo.diagnostics.artifacts import artifact_stats
from megatron_sdpo.diagnostics.param_drift import parameter_drift, principal_weight_overlap, update_mask_overlap
from megatron_sdpo.diagnostics.response_drift import Embedder, excess_kl, response_drift
from megatron_sdpo.diagnostics.token_artifacts import artifact_endorsement, mask_tensor, token_artifact_masks

# Eval answers per set that the response drift embeds, in units of probe_n.
_DRIFT_PROBES_PER_KL_PROBE = 4


@dataclass(frozen=True)
class StagePolicies:
    """HF policy directories around stage k: the base, the policy before the stage (`prev`: the
    base for k == 0), after it (`cur`), and before the previous stage (`before_prev`, None for
    k == 0: there is no previous update)."""

    base: Path
    prev: Path
    cur: Path
    before_prev: Path | None = None


@dataclass(frozen=True)
class ProbeLogprobs:
    """[B, T] fp32 log-probs of the policy's own probe answers under the policy and under the
    base, and the [B, T] response mask; optionally the answers' token ids and per-token text
    pieces (each id decoded alone) for the token-level artifact rates."""

    policy: torch.Tensor
    base: torch.Tensor
    mask: torch.Tensor
    response_ids: list[list[int]] | None = None
    pieces: list[list[str]] | None = None


def in_domain_sets(samples: dict[str, list[dict]]) -> list[str]:
    """The in-distribution eval sets ("<domain>/id") of an eval-samples dict, sorted."""
    return sorted(key for key in samples if key.endswith("/id"))


def probe_batches(
    tokenizer, cur_samples: dict[str, list[dict]], eval_sets: dict[str, list[dict]], probe_n: int
) -> dict:
    """{eval set: SequenceBatch} of the first `probe_n` answers of the policy to each in-domain
    eval set (prompts through the chat template; an empty answer scored as one eos token);
    answers whose record is not in `eval_sets` are left out."""
    from megatron_sdpo.chat import record_prompts
    from megatron_sdpo.interfaces.backend import SequenceBatch

    out = {}
    for key in in_domain_sets(cur_samples):
        records = {r["id"]: r for r in eval_sets[key]}
        probe = [s for s in cur_samples[key][:probe_n] if s["id"] in records]
        if not probe:
            continue
        prompts = record_prompts(tokenizer, [records[s["id"]] for s in probe])
        ids = [
            tokenizer(s["response"], add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for s in probe
        ]
        out[key] = SequenceBatch(prompt_ids=prompts, response_ids=ids)
    return out


def _drift_summary(result: dict) -> dict:
    """The aggregate part of a parameter_drift result (per-matrix records stay out of reports)."""
    return {k: v for k, v in result.items() if k not in ("matrices", "vectors")}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def token_artifacts(lp: ProbeLogprobs) -> dict | None:
    """Token-level artifact rates of the probe answers and the endorsement of their artifact
    tokens (format repeats or repeated n-grams) by the policy and by the base; None without ids."""
    if lp.response_ids is None or lp.pieces is None:
        return None
    masks = token_artifact_masks(lp.pieces, lp.response_ids)
    total = sum(len(r) for r in lp.response_ids)
    rates = {f"{k}_token_rate": (sum(map(sum, m)) / total if total else None) for k, m in masks.items()}
    rows, width = lp.mask.shape
    art = mask_tensor(masks["any"], (rows, width))
    return {
        "tokens": total,
        **rates,
        "endorsement_policy": artifact_endorsement(lp.policy, art, lp.mask),
        "endorsement_base": artifact_endorsement(lp.base, art, lp.mask),
    }


def stage_diagnostics(
    stage: int,
    domain: str,
    algorithm: str,
    policies: StagePolicies,
    base_samples: dict[str, list[dict]],
    cur_samples: dict[str, list[dict]],
    probes: dict[str, ProbeLogprobs],
    *,
    svd_rank: int,
    seed: int,
    probe_n: int,
    embedder: Embedder | None,
    principal_overlap: bool = True,
) -> dict:
    """The drift record of stage `stage` (0-based) trained on `domain`.

    base_samples / cur_samples: {eval set: [{"id", "response", ...}]} answers of the base and
    of this stage's policy; probes: per in-domain eval set, the log-probs of `probe_batches`'
    answers; embedder: for the response drift (None: not measured); principal_overlap: whether
    to measure the overlap of the stage's update with the principal weights of `policies.prev`
    (one more rank-`svd_rank` SVD per matrix)."""
    out: dict = {"stage": stage + 1, "domain": domain, "algorithm": algorithm}
    p = policies
    out["param_vs_prev"] = _drift_summary(parameter_drift(p.prev, p.cur, rank=svd_rank, seed=seed))
    out["param_vs_base"] = (
        out["param_vs_prev"] if stage == 0 else _drift_summary(parameter_drift(p.base, p.cur, rank=svd_rank, seed=seed))
    )
    if p.before_prev is not None:
        overlap = update_mask_overlap((p.before_prev, p.prev), (p.prev, p.cur), top_percent=1.0)
        out["mask_overlap_vs_prev_update"] = {key: v for key, v in overlap.items() if key != "matrices"}
    if principal_overlap:
        # The update's top-1% mask, as the Jaccard above, against the top-1% principal weights.
        principal = principal_weight_overlap(p.prev, p.cur, rank=svd_rank, top_percent=1.0, seed=seed)
        out["principal_overlap"] = {key: v for key, v in principal.items() if key != "matrices"}

    responses: dict = {}
    kl: dict = {}
    n_drift = probe_n * _DRIFT_PROBES_PER_KL_PROBE
    for key in in_domain_sets(cur_samples):
        ours = [s["response"] for s in cur_samples[key]]
        theirs = [s["response"] for s in base_samples.get(key, [])]
        entry = {"artifacts": artifact_stats(ours), "artifacts_base": artifact_stats(theirs) if theirs else None}
        if embedder is not None and len(theirs) == len(ours):
            entry["drift"] = response_drift(theirs[:n_drift], ours[:n_drift], embedder)
        responses[key] = entry
        if key in probes:
            # Excess KL: log pi(y|x) - log pi_base(y|x) on the policy's own answers.
            lp = probes[key]
            kl[key] = {k2: float(v) for k2, v in excess_kl(lp.policy, lp.base, lp.mask).items()}
            tokens = token_artifacts(lp)
            if tokens is not None:
                entry["token_artifacts"] = tokens
    out["responses"] = responses
    out["excess_kl"] = kl
    out["excess_kl_mean_k3"] = _mean([v["kl_k3"] for v in kl.values() if v["kl_k3"] == v["kl_k3"]])
    out["response_cosine_mean"] = _mean([e["drift"]["cosine_mean"] for e in responses.values() if "drift" in e])
    out["response_mmd_mean"] = _mean([e["drift"]["mmd"] for e in responses.values() if "drift" in e])
    return out
