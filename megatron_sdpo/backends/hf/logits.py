"""The HF backend's output head: the decoder's hidden states at the response columns through the
output projection in fp32, and the per-token quantities the losses take from those logits."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sdpo.backends.varlen import gather_hidden
from megatron_sdpo.backends.vocab_parallel import topk_logprobs as vocab_parallel_topk
from megatron_sdpo.errors import ConfigError
from megatron_sdpo.interfaces.distillation import DistillationSpec
from megatron_sdpo.interfaces.layout import token_logprobs


class ResponseLogits(nn.Module):
    """Runs the decoder and the output projection on the response columns only, in fp32.

    Taking hidden states P-1 .. P+T-2 before the output projection avoids computing logits
    over the prompt, and doing the projection in fp32 avoids rounding bf16 GEMM outputs before
    the log-softmax. DDP wraps this module so the backward hooks see every parameter used."""

    def __init__(self, lm: nn.Module, temperature: float = 1.0):
        super().__init__()
        self.lm = lm
        # Every model's logits are divided by the rollout's sampling temperature (as verl and TRL
        # do), so trainer log-probs are those of the distribution the engine sampled from.
        self.temperature = float(temperature)
        cfg = lm.config
        for unsupported in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, unsupported, None) not in (None, 1.0):
                raise ConfigError(
                    f"model config sets {unsupported}; the HF backend's fp32 output projection does not implement it"
                )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
        position_ids: torch.Tensor,
        select: int | torch.Tensor,
        hidden_only: bool = False,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[R, L] ids/positions -> [B, T, V] fp32 logits / temperature predicting the response
        tokens (or, with hidden_only, the [B, T, H] final hidden states that predict them: the
        kernels that take them divide by the temperature themselves). `select` is T
        for the padded layout (the responses end every row; `attention_mask` [R, L]) or, for
        the packed layout, its [B, T] `hidden_index` (`attention_mask` None: the positions
        delimit the samples; or, with shared prompts, the layout's [R, 1, L, L] mask in the
        form the model's attention implementation takes, per layer type where layers slide:
        `layer_masks`). With `keep`
        ([B, T] bool) only those positions, row-major: [N, V] (or [N, H]); a batch's T is its
        longest response, so the projection then skips the other responses' padding columns."""
        lm = cast(Any, self.lm)  # a transformers PreTrainedModel
        decoder = getattr(lm, lm.base_model_prefix)
        hidden = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        if isinstance(select, torch.Tensor):
            h = gather_hidden(hidden, select if keep is None else select[keep])
        else:
            L = hidden.shape[1]
            h = hidden[:, L - select - 1 : L - 1]
            if keep is not None:
                h = h[keep]
        if hidden_only:
            return h
        head = lm.get_output_embeddings()
        bias = None if head.bias is None else head.bias.float()
        logits = F.linear(h.float(), head.weight.float(), bias)
        return logits if self.temperature == 1.0 else logits / self.temperature


def layer_masks(allowed: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor | dict[str, torch.Tensor]:
    """The shared layout's [R, 1, W, W] bool mask (True = attend) as the model's layers take it.

    A prepared 4D mask reaches the attention functions as given: transformers applies no
    sliding window of its own to it. So where layers slide, their mask is cut to the window
    here, in the samples' own positions (`positions`, [R, W]): query i sees key j iff
    i - window < j <= i (masking_utils.sliding_window_overlay, as vLLM and the megatron
    backend's window_fields). Models that mix layer types take {layer type: mask}; a model
    whose every layer slides (no layer_types) takes the one windowed mask."""
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())
    slides = "sliding_attention" in types if types else bool(getattr(config, "use_sliding_window", True))
    if not window or not slides:
        return allowed
    near = (positions[:, None, :, None] - positions[:, None, None, :]) < window
    if not types:
        return allowed & near
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise ConfigError(
            f"share_prompts: layer types {sorted(unknown)} have no mask here; set backend.share_prompts=false"
        )
    return {"full_attention": allowed, "sliding_attention": allowed & near}


def topk_logprobs(
    logits: torch.Tensor, t_logits: torch.Tensor, spec: DistillationSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, V] student / teacher logits -> [B, T, k] full-vocabulary log-probs of the
    student's top-k ids (k and temperature from the spec): the vocab-parallel selection
    over a single shard, so both backends pick the ids the same way."""
    if spec.topk is None:
        raise ValueError("top-k log-probs need spec.topk")
    temp = spec.temperature
    top_s, top_t, _ = vocab_parallel_topk(
        logits.float() / temp, t_logits.float() / temp, spec.topk, 0, logits.shape[-1], None
    )
    return top_s, top_t


def masked_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[N, V] logits at the `keep` positions ([B, T] bool, row-major) -> [B, T] fp32 log-probs
    of `targets` [B, T] there and 0 elsewhere (differentiable w.r.t. the logits)."""
    lp = token_logprobs(logits.unsqueeze(0), targets[keep].unsqueeze(0)).squeeze(0)
    return lp.new_zeros(keep.shape).masked_scatter(keep, lp)
