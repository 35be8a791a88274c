"""HF transformers backend: a causal LM policy, its teacher and torch DDP over gloo/NCCL (the
CPU and small-model seam; `backends/megatron/` is the one at scale).

backend.py the backend; teacher.py the teacher (model, fp32 shadow, trust-region mix);
logits.py the response logits, masks and top-k; checkpoint.py saving and loading a run.
"""

from megatron_sdpo.backends.hf.backend import HFBackend

__all__ = ["HFBackend"]
