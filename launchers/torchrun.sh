#!/usr/bin/env bash
# Thin torchrun wrapper: every rank runs `python -m megatron_sdpo "$@"`; no training logic here.
#
# Usage:
#   launchers/torchrun.sh [--nproc-per-node N] [--nnodes N] [--] SUBCOMMAND [ARGS ...]
#   launchers/torchrun.sh --nproc-per-node 8 run qwen3_4b backend.lr=5.0e-6 --out runs/q4b
# Options fall back to the environment:
#   NPROC_PER_NODE  processes per node (default: the GPUs in CUDA_VISIBLE_DEVICES, else those
#                   nvidia-smi lists, else 1)
#   NNODES          nodes in the job (default 1)
#   MASTER_ADDR / MASTER_PORT  c10d rendezvous endpoint; required when NNODES > 1 (the same on
#                   every node). With one node and no MASTER_ADDR, torchrun --standalone picks
#                   a free local port.
#   RDZV_ID         rendezvous id shared by all nodes (default: SLURM_JOB_ID, else "megatron_sdpo")
#   PYTHON          interpreter each rank runs (default: python from PATH)
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

is_count() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

nproc="${NPROC_PER_NODE:-}"
nnodes="${NNODES:-1}"
while (($#)); do
  case "$1" in
    --nproc-per-node|--nproc_per_node)
      (($# >= 2)) || die "$1 needs a value"
      nproc="$2"; shift 2 ;;
    --nproc-per-node=*|--nproc_per_node=*) nproc="${1#*=}"; shift ;;
    --nnodes)
      (($# >= 2)) || die "$1 needs a value"
      nnodes="$2"; shift 2 ;;
    --nnodes=*) nnodes="${1#*=}"; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (options before the megatron_sdpo subcommand: --nproc-per-node, --nnodes)" ;;
    *) break ;;
  esac
done
(($#)) || die "no megatron_sdpo subcommand given (e.g. run PRESET [key=value ...] --out DIR)"

if [[ -z "${nproc}" ]]; then
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES}"
    nproc="${#visible[@]}"
    source_of_nproc="CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi > /dev/null && gpus="$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')" && ((gpus > 0)); then
    nproc="${gpus}"
    source_of_nproc="nvidia-smi"
  else
    nproc=1
    source_of_nproc="no GPU found"
  fi
else
  source_of_nproc="set"
fi
is_count "${nproc}" || die "--nproc-per-node must be a positive integer, got '${nproc}'"
is_count "${nnodes}" || die "--nnodes must be a positive integer, got '${nnodes}'"

command -v torchrun > /dev/null || die "torchrun is not on PATH (activate the environment that has torch)"
python="${PYTHON:-python}"
command -v "${python}" > /dev/null || die "${python} is not on PATH (activate the environment or set PYTHON)"

rdzv=()
if [[ -n "${MASTER_ADDR:-}" ]]; then
  rdzv=(--rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT:-29500}"
        --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-megatron_sdpo}}")
elif ((nnodes > 1)); then
  die "--nnodes ${nnodes} needs MASTER_ADDR (and MASTER_PORT) set to the same host on every node"
else
  rdzv=(--standalone)
fi

echo "[torchrun.sh] nnodes=${nnodes} nproc-per-node=${nproc} (${source_of_nproc}) ${rdzv[*]}" >&2
exec torchrun --nnodes="${nnodes}" --nproc-per-node="${nproc}" "${rdzv[@]}" --max-restarts=0 \
  --no-python "${python}" -m megatron_sdpo "$@"
