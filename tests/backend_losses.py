"""Small LossFns (interfaces/backend.py) that the backend and rollout tests train with.

Importable from every test folder: pytest puts tests/ (the conftest's folder) on sys.path.
"""


class _LogprobLoss:
    """What both losses tell the LossFn protocol: they read log-probs and do not distill."""

    requires = frozenset({"logprobs"})
    distillation = None
    on_policy = False


class WeightedNLL(_LogprobLoss):
    """sum(-adv * logprob * loss_mask) / (loss tokens of the global batch); metric "tokens"."""

    mask_keys = ("loss_mask",)

    def global_normalizer(self, tensors):
        return tensors["loss_mask"].sum().clamp_min(1.0)

    def signal_rows(self, tensors):
        return (tensors["loss_mask"] != 0).any(1) & (tensors["advantages"] != 0)

    def __call__(self, outputs, tensors, normalizer):
        m = tensors["loss_mask"]
        per_tok = -outputs["logprobs"] * tensors["advantages"][:, None] * m
        return per_tok.sum() / normalizer, {"tokens": m.sum()}


class ResponseNLL(_LogprobLoss):
    """Mean negative log-likelihood of the response tokens (needs only the response mask)."""

    mask_keys = ("response_mask",)

    def global_normalizer(self, tensors):
        return tensors["response_mask"].sum()

    def signal_rows(self, tensors):
        return (tensors["response_mask"] != 0).any(1)

    def __call__(self, outputs, tensors, normalizer):
        return -(outputs["logprobs"] * tensors["response_mask"]).sum() / normalizer, {}
