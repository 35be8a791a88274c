#!/bin/bash
# The GPU checks, in parts that each fit in under 5 minutes of one GPU. From the repository root:
#
#   bash tests/gpu/run_gpu_checks.sh PART [PART ...] [--out DIR]      PART: kernels | megatron | all
#
# kernels   the Triton KL kernel against the reference (tests/kernels/test_kl_gpu.py) and the KL
#           benchmark at Qwen3-4B's (H 2560, V 151,936) and Olmo-3-7B's (H 4096, V 100,278) heads
# megatron  BF16 GRPO/SDPO steps at TP 1 (fused kernel vs vocab-sharded logits), packed rows
#           against padded rows, the memory ledger against the CUDA allocator (tests/gpu/)
#
# Each part first installs what it tests, offline: the wheel folder (GPU_WHEELS, default
# gpu_wheels/, filled by `make gpu-wheels` where the index is reachable) and the project itself
# from this checkout (no index, no build isolation, no dependencies), into DIR/site; its tests then
# import the installed copy. It collects its tests (a collection error fails the part), runs them
# and its benchmarks under hard time limits, and writes DIR/<part>/summary.txt. Without a CUDA GPU
# it stops after the collection and reports every check as skipped with its reason (exit 0). On a
# CUDA machine nothing it exists for is skipped: no wheel folder fails the run at once, and a part
# whose megatron-core, Triton or Liger is missing fails unrun (vLLM and Transformer Engine, whose
# CUDA wheels no offline folder carries, are skipped with their reason).
# PYTHON picks the interpreter (default python3); DIR defaults to gpu_checks/.
set -euo pipefail

PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-gpu_wheels}"
OUT="gpu_checks"
PARTS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    kernels|megatron) PARTS+=("$1"); shift ;;
    all) PARTS+=(kernels megatron); shift ;;
    *) echo "error: unknown part or option '$1' (parts: kernels, megatron, all; option: --out DIR)" >&2; exit 2 ;;
  esac
done
if [[ ${#PARTS[@]} -eq 0 ]]; then
  echo "error: name a part: kernels, megatron or all (see the header of $0)" >&2
  exit 2
fi
mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"
SITE="${OUT}/site"
# The installed project and wheels come first on the path (the build backend too).
export PYTHONPATH="${SITE}${PYTHONPATH:+:${PYTHONPATH}}"

# Seconds each step may take on the GPU (hard limits): with the install and the collection
# (~20 s) a part stays under 5 minutes whatever happens inside it. The kernels part: 8 tests
# (Triton compiles a kernel per dtype and alpha) and two benchmark calls of 5 cases each, every
# case a fresh process (~6-10 s: interpreter, CUDA context, the cached kernel); the megatron
# part: 5 tests, each in a fresh one-rank NCCL world (~15-60 s; the ledger check builds and saves
# a ~1.2B model first).
pytest_limit() { case "$1" in kernels) echo 90 ;; megatron) echo 240 ;; esac; }
BENCH_LIMIT=75
# The expected time, from what a part collects and benchmarks: seconds per test and per benchmark
# case as budgeted above (estimates until a GPU run replaces them), plus the install.
per_test() { case "$1" in kernels) echo 8 ;; megatron) echo 40 ;; esac; }
BENCH_CASES=10  # 2 shapes x 5 implementations, one process each
PER_CASE=10
INSTALL_S=20

install() {
  if ! "${PY}" -m pip --version > /dev/null 2>&1; then
    echo "error: ${PY} has no pip: the checks install the project with it" >&2
    exit 1
  fi
  if compgen -G "${WHEELS}/*.whl" > /dev/null; then
    # setuptools among them: the project's build backend here, and what torch's cpp_extension
    # (imported by megatron-core) needs where the interpreter has none.
    echo "installing $(ls "${WHEELS}"/*.whl | wc -l) wheel(s) from ${WHEELS}/ (no index)"
    "${PY}" -m pip install -q --no-index --no-deps --upgrade --target "${SITE}" "${WHEELS}"/*.whl
  fi
  echo "installing the project from $(pwd) (no index, no build isolation, no dependencies)"
  "${PY}" -m pip install -q --no-index --no-deps \
    --no-build-isolation --upgrade --target "${SITE}" .
}

# -P: the checkout is not put on sys.path, so the tests import the installed project.
py() { "${PY}" -P "$@"; }
# Whether every named module can be imported (parents first: find_spec of a child imports its parent).
has() { py -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)" "$@" 2> /dev/null; }

part_tests() {
  case "$1" in
    kernels) echo "tests/kernels/test_kl_gpu.py" ;;
    megatron) echo "tests/gpu/test_megatron_gpu_step.py tests/gpu/test_memory_ledger_gpu.py" ;;
  esac
}

# "check name|what it needs beyond a GPU": the lines of a part's summary.
part_checks() {
  case "$1" in
    kernels)
      echo "Triton KL kernel vs reference, fp32 and bf16, alpha 0 / 0.5 / 1|triton"
      echo "Liger's fused linear JSD agrees on the mean|liger_kernel"
      echo "KL benchmark at Qwen3-4B's head (H 2560, V 151,936; 8,192 tokens)|triton"
      echo "KL benchmark at Olmo-3-7B's head (H 4096, V 100,278; 8,192 tokens)|triton" ;;
    megatron)
      echo "megatron BF16 GRPO/SDPO steps at TP 1 (fused kernel vs vocab-sharded logits)|megatron.core"
      echo "packed rows vs padded rows (BF16)|megatron.core"
      echo "memory ledger vs CUDA allocator (~1.2B Qwen3 shape)|megatron.core"
      echo "FP8 step through Transformer Engine|transformer_engine"
      echo "refit into a colocated vLLM engine|vllm" ;;
  esac
}

# The modules a part's code imports beyond the device image's packages.
part_imports() {
  case "$1" in
    kernels) echo "megatron_sdpo_kernels, megatron_sdpo_kernels.fused, megatron_sdpo.algorithms.divergence" ;;
    megatron) echo "megatron_sdpo.cli, megatron_sdpo.planning.memory_ledger, megatron_sdpo.interfaces.backend"
              if has megatron megatron.core; then
                echo ", megatron.core, megatron_sdpo.backends.megatron.backend"  # megatron-core's own imports too
              fi ;;
  esac
}

# What a CUDA machine may lack and still pass (skipped with the reason): the rest must be there.
OPTIONAL_ON_GPU="vllm transformer_engine"

missing_reason() {  # why a check cannot run here, or nothing
  local need="$1"
  if [[ -z "${CUDA}" ]]; then echo "no CUDA GPU visible"; return; fi
  if ! has "${need%%.*}" "${need}"; then
    case "${need}" in
      vllm|transformer_engine)
        echo "${need} is not installed (its wheels, hundreds of MB with their CUDA libraries, are beyond what an offline wheel folder carries; run it on a cluster node with the gpu extra)" ;;
      *) echo "${need} is not installed (add it to ${WHEELS}/: make gpu-wheels)" ;;
    esac
  fi
}

run_part() {
  local part="$1" dir="${OUT}/$1" start=$SECONDS status=0
  mkdir -p "${dir}"
  : > "${dir}/summary.txt"
  say() { echo "$*" | tee -a "${dir}/summary.txt"; }
  say "part ${part}: ${PY} ($(py -c 'import platform; print(platform.python_version())')), torch $(py -c 'import torch; print(torch.__version__)')"
  local line name need reason
  if [[ -n "${CUDA}" ]]; then
    local lacking=0
    while IFS= read -r line; do
      name="${line%%|*}" need="${line##*|}"
      reason=$(missing_reason "${need}")
      if [[ -n "${reason}" && " ${OPTIONAL_ON_GPU} " != *" ${need} "* ]]; then
        say "FAILED ${name}: ${need} is not installed on this CUDA machine (add it to ${WHEELS}/: make gpu-wheels)"
        lacking=1
      fi
    done < <(part_checks "${part}")
    if ((lacking)); then
      say "part ${part} finished with status 1 in $((SECONDS - start)) s: not run, what it checks is missing"
      return 1
    fi
  fi
  py -W ignore -c "import $(part_imports "${part}" | tr -d '\n')" || { say "FAILED import of the installed project"; return 1; }
  # shellcheck disable=SC2046
  if ! py -m pytest --collect-only -q -p no:cacheprovider $(part_tests "${part}") > "${dir}/collect.log" 2>&1; then
    tail -20 "${dir}/collect.log"
    say "FAILED collection: $(tail -1 "${dir}/collect.log")"
    return 1
  fi
  local collected
  collected=$(grep -c "::" "${dir}/collect.log" || true)
  local cases=0
  [[ "${part}" == kernels ]] && cases=${BENCH_CASES}
  say "collected ${collected} tests from $(part_tests "${part}"); expected on the GPU: ${INSTALL_S} s install +" \
      "${collected} x $(per_test "${part}") s tests + ${cases} x ${PER_CASE} s benchmark cases =" \
      "$((INSTALL_S + collected * $(per_test "${part}") + cases * PER_CASE)) s; limits: pytest $(pytest_limit "${part}") s$([[ "${part}" == kernels ]] && echo ", each benchmark call ${BENCH_LIMIT} s")"
  if [[ -n "${CUDA}" ]]; then
    say "${CUDA}"
    # -rs lists every skip with its reason (e.g. no Transformer Engine -> no FP8 step).
    # shellcheck disable=SC2046
    timeout "$(pytest_limit "${part}")" "${PY}" -P -m pytest -m gpu \
      -p no:cacheprovider -rs -s -q $(part_tests "${part}") 2>&1 | tee "${dir}/pytest.log" || status=$?
    say "pytest: $(tail -1 "${dir}/pytest.log")"
    if [[ "${part}" == kernels ]]; then
      local impls
      impls="reference,triton"
      if has megatron megatron.core; then impls+=",megatron_logits,megatron_fused"; fi
      if has liger_kernel; then impls+=",liger"; fi
      # Not -P: a script needs its own folder on the path (bench_kl imports bench_harness beside
      # it); the checkout root is not put there for a script, so the installed project is used.
      timeout "${BENCH_LIMIT}" "${PY}" tools/bench_kl.py --device cuda \
        --dtype bfloat16 --hidden 2560 --vocab 151936 --tokens 8192 --impls "${impls}" --repeats 3 \
        --out "${dir}/bench_kl_qwen3_4b.csv" 2>&1 | tee "${dir}/bench_kl_qwen3_4b.log" || status=$?
      timeout "${BENCH_LIMIT}" "${PY}" tools/bench_kl.py --device cuda \
        --dtype bfloat16 --hidden 4096 --vocab 100278 --tokens 8192 --impls "${impls}" --repeats 3 \
        --out "${dir}/bench_kl_olmo3_7b.csv" 2>&1 | tee "${dir}/bench_kl_olmo3_7b.log" || status=$?
    fi
  fi
  while IFS= read -r line; do
    name="${line%%|*}" need="${line##*|}"
    reason=$(missing_reason "${need}")
    if [[ -n "${reason}" ]]; then say "SKIPPED ${name}: ${reason}"; fi
  done < <(part_checks "${part}")
  say "part ${part} finished with status ${status} in $((SECONDS - start)) s; outputs in ${dir}/"
  return "${status}"
}

CUDA=$(py -c "
import torch
if torch.cuda.is_available():
    cap = ''.join(map(str, torch.cuda.get_device_capability()))
    print(f'GPU: {torch.cuda.get_device_name()} (sm_{cap}), torch {torch.__version__}')
")
if [[ -n "${CUDA}" ]] && ! compgen -G "${WHEELS}/*.whl" > /dev/null; then
  # On a GPU a missing wheel folder would turn every megatron check into a skip: a green run
  # with nothing run.
  echo "error: a CUDA GPU is here but ${WHEELS}/ holds no wheel (make gpu-wheels, or GPU_WHEELS=DIR)" >&2
  exit 1
fi
install
status=0
for part in "${PARTS[@]}"; do
  run_part "${part}" || status=$?
done
exit "${status}"
