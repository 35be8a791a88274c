"""Fused token-level KL kernels (installed as megatron_sdpo.kernels)."""
