#!/bin/bash
# The GPU checks in one go, for a machine with a CUDA GPU and the GPU stack installed
# (pip install -e .[gpu,dev]). Run from the repository root:
#   bash tests/gpu/run_gpu_checks.sh [OUT_DIR]
# Writes OUT_DIR/pytest.log and OUT_DIR/bench_kl_gpu.csv (default OUT_DIR: gpu_checks/).
# Checks: megatron TP=1 GRPO and SDPO steps in BF16 (fused kernel vs vocab-sharded logits), an
# FP8 step when Transformer Engine and the GPU support it, a refit of the trained policy into
# vLLM (prompt logprobs against the trainer's), the Triton KL kernel against the reference, and
# the KL benchmark at V=151,936 (logits path vs fused, peak memory and time).
set -euo pipefail

OUT="${1:-gpu_checks}"
PY="${PYTHON:-python}"
mkdir -p "${OUT}"

"${PY}" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible: these checks need one"
print(f"GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
      f"torch {torch.__version__}")
PYEOF

status=0
# -rs lists every skip with its reason (e.g. no Transformer Engine -> no FP8 step).
timeout 1500 "${PY}" -m pytest -m gpu -p no:cacheprovider -rs -s -q \
  tests/gpu tests/kernels/test_kl_gpu.py 2>&1 | tee "${OUT}/pytest.log" || status=$?

timeout 900 "${PY}" tools/bench_kl.py --device cuda --dtype bfloat16 --hidden 2560 --vocab 151936 \
  --tokens 1024,4096 --impls megatron_logits,megatron_fused,triton --repeats 3 \
  --out "${OUT}/bench_kl_gpu.csv" 2>&1 | tee "${OUT}/bench_kl.log" || status=$?

echo "GPU checks finished with status ${status}; outputs in ${OUT}/"
exit "${status}"
