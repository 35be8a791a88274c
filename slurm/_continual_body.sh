#!/bin/bash
# The body of the continual post-training sbatch jobs: slurm/continual_7b.sh and
# slurm/continual_4b.sh hold the #SBATCH header and the preset and exec this script with
#   bash slurm/_continual_body.sh PRESET [key=value ...]
# It is not submitted itself (it has no #SBATCH header).
#
# Environment (all optional, exported to the job by sbatch):
#   RUN_ROOT     where run directories go             (default: $SLURM_SUBMIT_DIR/runs)
#   RUN_NAME     run directory name under RUN_ROOT    (default: PRESET-$SLURM_JOB_ID)
#   RUN_DIR      full run directory; wins over RUN_ROOT/RUN_NAME. Set it to an existing run to
#                continue that run in a new job.
#   GPUS_PER_NODE  processes per node                 (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT  rendezvous port on the first node    (default: derived from the job id)
#   CONTAINER_IMAGE / CONTAINER_MOUNTS  run inside a pyxis/enroot container when set
#
# No training logic lives here: a preflight `python -m megatron_sdpo run PRESET ... --dry-run`
# (config, layout for this allocation, data, memory; no weights) on one node, then every rank runs
# `python -m megatron_sdpo run PRESET ...`.
# Stopping: the job asks for USR1 a lead before its time limit (the #SBATCH --signal of the
# wrappers, whose path they export as SDPO_JOB_SCRIPT). The preflight computes the grace a stop
# needs (a step, the save of one node's ranks at checkpoint.write_gib_per_s, a margin), fails when
# the lead is shorter, and writes the lead and the save's reserve to a file this script sources
# (SDPO_STOP_LEAD_S, SDPO_STOP_RESERVE_S: megatron_sdpo/planning/stop_grace.py). Either signal
# reaches the ranks as SIGTERM: USR1 (the batch shell's alone) is passed on to the job's steps by
# `scancel --signal=TERM`; a TERM from scancel, a time limit or a preemption Slurm sends to every
# process of the job itself. Never `kill` srun: srun answers a signal by killing its tasks at
# once ("forcing job termination"), before any rank saves. The ranks agree to stop
# (megatron_sdpo/stop_request.py), finish their step when it fits the lead, else abandon it
# before its optimizer step, save the last completed step and exit; torchrun waits the lead
# (STOP_GRACE_S, default 540, when no lead is known) before it kills them. torchrun has
# --shutdown-timeout from torch 2.11 (pytorch/pytorch#172596); the preflight checks it.
# Only after USR1 does the job requeue itself; a plain TERM stays cancelled; a preempted job
# (Slurm sets its PreemptTime and signals the steps) requeues itself once its ranks saved, as
# Slurm would at the end of the partition's GraceTime. The requeued job keeps its id, finds the
# run directory with its resolved_config.yaml and passes --resume, so training continues from the
# step it stopped at. Which stops leave time for a save: docs/cluster.md ("Stopping a job").
# Networking: each rank sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, unless given, to the
# interface of its route to MASTER_ADDR (megatron_sdpo/network.py, from SDPO_NODES);
# the preflight prints node 0's choice.

set -euo pipefail

PRESET="${1:?usage: bash slurm/_continual_body.sh PRESET [key=value ...] (run by slurm/continual_*.sh under sbatch)}"
shift

for arg in "$@"; do
  case "${arg}" in
    --out|--out=*|--resume)
      echo "error: ${arg} is set by this script; choose the run directory with RUN_DIR or RUN_ROOT/RUN_NAME" >&2
      exit 2 ;;
  esac
done

: "${SLURM_JOB_ID:?submit this script with sbatch}"
RUN_ROOT="${RUN_ROOT:-${SLURM_SUBMIT_DIR}/runs}"
RUN_NAME="${RUN_NAME:-${PRESET}-${SLURM_JOB_ID}}"
RUN_DIR="${RUN_DIR:-${RUN_ROOT}/${RUN_NAME}}"

if [[ -f "${RUN_DIR}/report.md" ]]; then
  echo "run ${RUN_DIR} has already finished (report.md exists); nothing to do"
  exit 0
fi
RESUME=""
# resolved_config.yaml is written when a run starts: its presence is what `--resume` needs.
if [[ -f "${RUN_DIR}/resolved_config.yaml" ]]; then
  RESUME="--resume"
fi

# Rendezvous: the first node of the allocation hosts the c10d store. One port per job id so
# two jobs sharing a node do not collide.
# (No `| head -n 1`: under pipefail, scontrol's SIGPIPE would fail the job.)
mapfile -t NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
MASTER_ADDR="${NODES[0]:-}"
if [[ -z "${MASTER_ADDR}" ]]; then
  echo "error: cannot resolve the first node of SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST}'" >&2
  exit 1
fi
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
SDPO_NODES="${NODES[*]}"
export SDPO_NODES
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
STOP_GRACE_S="${STOP_GRACE_S:-540}"
export MASTER_ADDR MASTER_PORT

# The jobs' environment (slurm/cluster.env, which launchers/nemo_run.py reads too): each variable
# the submitting environment did not set.
while IFS='=' read -r key value; do
  [[ -z "${key}" || "${key}" == \#* ]] && continue
  [[ -n "${!key:-}" ]] || export "${key}=${value}"
done < "$(dirname "$0")/cluster.env"
# Compile caches on node-local disk: thousands of ranks writing one shared home is slow.
NODE_CACHE="${TMPDIR:-/tmp}/megatron_sdpo-${SLURM_JOB_ID}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${NODE_CACHE}/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${NODE_CACHE}/inductor}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-${NODE_CACHE}/vllm}"

CONTAINER_ARGS=()
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
  CONTAINER_ARGS=(--container-image="${CONTAINER_IMAGE}" --container-workdir="${SLURM_SUBMIT_DIR}"
                  --container-mounts="${CONTAINER_MOUNTS:-${SLURM_SUBMIT_DIR}:${SLURM_SUBMIT_DIR}}")
fi
SRUN_ARGS=(--nodes="${SLURM_JOB_NUM_NODES}" --ntasks-per-node=1 --kill-on-bad-exit=1
           --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" ${CONTAINER_ARGS[@]+"${CONTAINER_ARGS[@]}"})

SRUN_PID=""
SIGNALLED=""
REQUEUE=""
requeue() {
  echo "$(date '+%F %T') requeueing job ${SLURM_JOB_ID}; it resumes from ${RUN_DIR}"
  scontrol requeue "${SLURM_JOB_ID}" || echo "$(date '+%F %T') scontrol requeue failed: resubmit with RUN_DIR=${RUN_DIR}"
}
preempted() {  # Slurm selected the job for preemption (its PreemptTime is set)
  scontrol show job "${SLURM_JOB_ID}" 2>/dev/null | grep -q 'PreemptTime=[0-9]'
}
# The requeue waits for the ranks' save: requeueing first would kill the job before it is written.
# `scancel --signal` without --batch signals every process of the job's steps, not this shell.
on_time_limit() {
  SIGNALLED=1
  REQUEUE=1
  echo "$(date '+%F %T') time limit near: stopping job ${SLURM_JOB_ID} at the end of its step"
  if [[ -z "${SRUN_PID}" ]]; then requeue; exit 0; fi
  scancel --signal=TERM "${SLURM_JOB_ID}" || true
}
# A TERM to this shell comes with one to every step (scancel, the time limit, preemption without
# a grace time): Slurm signals the ranks itself, and passing it on would signal them twice.
on_term() {
  SIGNALLED=1
  echo "$(date '+%F %T') SIGTERM: job ${SLURM_JOB_ID} is stopping (Slurm signalled its steps)"
  [[ -n "${SRUN_PID}" ]] || exit 143
}
trap on_time_limit USR1
trap on_term TERM

echo "$(date '+%F %T') job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): ${SLURM_JOB_NUM_NODES} node(s) x" \
     "${GPUS_PER_NODE} GPU(s), rendezvous ${MASTER_ADDR}:${MASTER_PORT}, run ${RUN_DIR} ${RESUME}"

# Preflight: the same command with --dry-run --strict for this allocation's world size, one task on
# one node: a bad override, layout or data schema, a data file missing, a model the ranks could not
# load or a memory plan over the GPU stops the job here, before any rank loads weights.
WORLD=$((SLURM_JOB_NUM_NODES * GPUS_PER_NODE))
# In the submit directory (mounted in a container too): the preflight writes it, this script reads it.
mkdir -p "${SLURM_SUBMIT_DIR}/logs"
LAUNCH_ENV="${SLURM_SUBMIT_DIR}/logs/launch-${SLURM_JOB_ID}.env"
rm -f "${LAUNCH_ENV}"
# The preflight reads the job script's #SBATCH --signal lead. Slurm runs a spool copy of it that a
# container does not see: the preflight gets a copy in the submit directory.
JOB_SCRIPT=""
if [[ -n "${SDPO_JOB_SCRIPT:-}" ]]; then
  JOB_SCRIPT="${SLURM_SUBMIT_DIR}/logs/job-${SLURM_JOB_ID}.sh"
  cp "${SDPO_JOB_SCRIPT}" "${JOB_SCRIPT}"
fi
preflight=0
srun --nodes=1 --ntasks=1 ${CONTAINER_ARGS[@]+"${CONTAINER_ARGS[@]}"} \
  python -m megatron_sdpo run "${PRESET}" "$@" --dry-run --strict --world-size "${WORLD}" \
    ${JOB_SCRIPT:+--job-script "${JOB_SCRIPT}"} --launch-env "${LAUNCH_ENV}" || preflight=$?
if ((preflight != 0)); then
  echo "$(date '+%F %T') preflight (--dry-run) failed with status ${preflight}; nothing launched"
  exit "${preflight}"
fi
if [[ -f "${LAUNCH_ENV}" ]]; then
  # shellcheck source=/dev/null
  source "${LAUNCH_ENV}"
fi

# srun in the background: bash runs a trap only between commands, and `wait` is interruptible.
srun "${SRUN_ARGS[@]}" \
  torchrun --nnodes="${SLURM_JOB_NUM_NODES}" --nproc-per-node="${GPUS_PER_NODE}" \
    --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id="${SLURM_JOB_ID}" \
    --max-restarts=0 --shutdown-timeout="${SDPO_STOP_LEAD_S:-${STOP_GRACE_S}}" --no-python \
  python -m megatron_sdpo run "${PRESET}" "$@" --out "${RUN_DIR}" ${RESUME:+"${RESUME}"} --quiet &
SRUN_PID=$!

status=0
wait "${SRUN_PID}" || status=$?
# A trapped signal makes `wait` return early (128 + signal number) whether or not srun has
# exited: wait again for srun's own status (127: it was already collected).
while [[ -n "${SIGNALLED}" ]]; do
  SIGNALLED=""
  again=0
  wait "${SRUN_PID}" || again=$?
  ((again == 127)) || status="${again}"
done
echo "$(date '+%F %T') srun exited with status ${status}"
# Preemption with a GraceTime signals only the steps: the ranks save and exit, and this shell
# would end the job as finished (or failed) before the grace ends, when Slurm would requeue it.
if [[ -z "${REQUEUE}" ]] && preempted; then
  echo "$(date '+%F %T') job ${SLURM_JOB_ID} was preempted"
  REQUEUE=1
fi
if [[ -n "${REQUEUE}" ]]; then
  requeue
fi
exit "${status}"
