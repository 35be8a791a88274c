#!/bin/bash
# The GPU checks in one go. Run from the repository root:
#   bash tests/gpu/run_gpu_checks.sh [OUT_DIR]
# Writes OUT_DIR/pytest.log, OUT_DIR/bench_kl_gpu.csv and OUT_DIR/checks.txt (default OUT_DIR:
# gpu_checks/). Checks: megatron TP=1 GRPO and SDPO steps in BF16 (fused kernel vs vocab-sharded
# logits), packed rows, an FP8 step when Transformer Engine and the GPU support it, a refit into
# vLLM, the memory ledger against the CUDA allocator (a ~1.2B Qwen3 shape), the Triton KL kernel
# against the reference, and the KL benchmark at Qwen3-4B's (H 2560, V 151,936) and Olmo-3-7B's
# (H 4096, V 100,278) shapes against eager and Liger's fused linear JSD.
#
# Offline machines: a folder of wheels (GPU_WHEELS, default gpu_wheels/; `make gpu-wheels`
# fills it where the package index is reachable) is installed with --no-index first, and the
# project is imported from this checkout. Without a CUDA GPU every check is skipped with its
# reason and the script exits 0; without megatron-core, vLLM or Transformer Engine the checks
# that need them are skipped with theirs (pytest -rs).
set -euo pipefail

OUT="${1:-gpu_checks}"
PY="${PYTHON:-python}"
WHEELS="${GPU_WHEELS:-gpu_wheels}"
mkdir -p "${OUT}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"

if compgen -G "${WHEELS}/*.whl" > /dev/null; then
  echo "installing $(ls "${WHEELS}"/*.whl | wc -l) wheel(s) from ${WHEELS}/ (no index)"
  "${PY}" -m pip install -q --no-index --no-deps "${WHEELS}"/*.whl
fi

cuda=$("${PY}" - <<'PYEOF'
import torch
if torch.cuda.is_available():
    cap = "".join(map(str, torch.cuda.get_device_capability()))
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{cap}), torch {torch.__version__}")
PYEOF
)
: > "${OUT}/checks.txt"
if [[ -z "${cuda}" ]]; then
  for check in "megatron BF16 GRPO/SDPO steps" "packed rows" "FP8 step" "vLLM refit" \
               "memory ledger vs CUDA allocator" "Triton KL kernel vs reference" \
               "KL benchmark (bench_kl.py --device cuda)"; do
    echo "SKIPPED ${check}: no CUDA GPU visible" | tee -a "${OUT}/checks.txt"
  done
  exit 0
fi
echo "${cuda}" | tee -a "${OUT}/checks.txt"

status=0
# -rs lists every skip with its reason (e.g. no Transformer Engine -> no FP8 step).
timeout 1500 "${PY}" -m pytest -m gpu -p no:cacheprovider -rs -s -q \
  tests/gpu tests/kernels/test_kl_gpu.py 2>&1 | tee "${OUT}/pytest.log" || status=$?

# The megatron arms need megatron-core; Liger's fused linear JSD is the outside peer where installed.
impls=$("${PY}" - <<'PYEOF'
import importlib.util as u
arms = ["reference", "triton"]
if u.find_spec("megatron") and u.find_spec("megatron.core"):
    arms += ["megatron_logits", "megatron_fused"]
else:
    print("SKIPPED bench_kl megatron arms: megatron-core not installed", file=__import__("sys").stderr)
if u.find_spec("liger_kernel"):
    arms.append("liger")
print(",".join(arms))
PYEOF
)
timeout 900 "${PY}" tools/bench_kl.py --device cuda --dtype bfloat16 --hidden 2560 --vocab 151936 \
  --tokens 1024,4096,8192 --impls "${impls}" --repeats 3 \
  --out "${OUT}/bench_kl_gpu.csv" 2>&1 | tee "${OUT}/bench_kl.log" || status=$?
timeout 600 "${PY}" tools/bench_kl.py --device cuda --dtype bfloat16 --hidden 4096 --vocab 100278 \
  --tokens 8192 --impls "${impls}" --repeats 3 \
  --out "${OUT}/bench_kl_gpu_olmo.csv" 2>&1 | tee "${OUT}/bench_kl_olmo.log" || status=$?

echo "GPU checks finished with status ${status}; outputs in ${OUT}/" | tee -a "${OUT}/checks.txt"
exit "${status}"
