#!/bin/bash
# Olmo-3-7B continual post-training (MATH -> SCIENCE -> TOOLUSE -> CODING), preset `olmo3_7b`,
# on two nodes (megatron-core TP=4, data parallel across nodes).
#
# Usage (from the repository root; Slurm opens logs/ before the script runs, so create it first):
#   mkdir -p logs && sbatch [-A ACCOUNT] [-p PARTITION] slurm/continual_7b.sh [key=value ...]
# with the Python environment activated (sbatch exports it to the job) or CONTAINER_IMAGE set.
# Environment variables (RUN_ROOT, RUN_NAME, RUN_DIR, GPUS_PER_NODE, MASTER_PORT,
# CONTAINER_IMAGE, CONTAINER_MOUNTS), preflight and requeue: see slurm/_continual_body.sh, which
# this script runs with its preset.
#
#SBATCH --job-name=sdpo-olmo3-7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
# USR1 twelve minutes before the time limit. A stop needs its step, the save and a margin: 719 s
# by `run olmo3_7b --dry-run` (a step planned at 518 s with every answer at 12,288 tokens, then
# 136 GiB from the first node at checkpoint.write_gib_per_s = 1 GiB/s); the preflight fails when the lead is
# shorter and names the lead to use. A --signal given to sbatch on the command line: set
# SDPO_STOP_LEAD_S to it too (the job cannot read it).
#SBATCH --signal=B:USR1@720

set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool directory, so the body is found from the
# submit directory (the repository root). exec keeps this process: the time-limit USR1 reaches
# the body's trap.
BODY="${SLURM_SUBMIT_DIR:-.}/slurm/_continual_body.sh"
if [[ ! -f "${BODY}" ]]; then
  echo "error: ${BODY} not found; submit from the repository root (sbatch slurm/continual_7b.sh)" >&2
  exit 2
fi
# The body reads this script's #SBATCH --signal lead (the preflight checks the stop grace against it).
export SDPO_JOB_SCRIPT="$0"
exec bash "${BODY}" olmo3_7b "$@"
