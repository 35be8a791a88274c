#!/bin/bash
# A real two-node Slurm cluster on one Linux machine, for trying and testing the sbatch and
# NeMo-Run paths (docs/cluster.md, "Try the cluster path on one machine"). Needs root and the
# distribution's packages (slurmctld, slurmd, slurm-client, munge; installed here with apt-get
# when missing).
#
#   bash tools/cluster.sh up       # idempotent: starts what is not running
#   bash tools/cluster.sh down     # ends every daemon it started (by pid), removes its
#                                  # namespaces, links and /etc/hosts lines; safe to repeat
#   bash tools/cluster.sh status   # what runs, and `sinfo`
#   bash tools/cluster.sh env      # the line to source: export SLURM_CONF=...
#
# Layout: munged and slurmctld in the root namespace, slurmctld on a bridge address; each node
# a slurmd in its own network namespace (a veth on the bridge, named NODE_IF inside) and UTS
# namespace (its own hostname), so `hostname`, the node's address and the interface a rank picks
# are a real second host's. Jobs run as the submitting user (root here) on the machine's one
# filesystem, as on a cluster with a shared home.
#
# Stops, as configured here (slurm.conf below): KillWait=60 s (Slurm's default is 30), the
# time from the TERM of `scancel` or of a time limit to the SIGKILL; two partitions over the
# same nodes, `main` and `urgent` (higher PriorityTier), with PreemptType=preempt/partition_prio
# and PreemptMode=REQUEUE: a job submitted to `urgent` preempts one in `main`, which gets TERM,
# GraceTime (60 s) and is requeued.
set -euo pipefail

DIR="${SDPO_CLUSTER_DIR:-/var/tmp/megatron_sdpo-cluster}"
BRIDGE="${SDPO_CLUSTER_BRIDGE:-sdpobr0}"
NET="${SDPO_CLUSTER_NET:-10.231.0}"   # a /24 that lives only on this bridge and its namespaces
NODES=(sdpo-node1 sdpo-node2)
NODE_IF=sdpo0
CTLD_ADDR="${NET}.1"
CTLD_HOST="$(hostname -s)"
HOSTS_TAG="# megatron_sdpo test cluster"
KILL_WAIT_S=60
GRACE_S=60
export SLURM_CONF="${DIR}/slurm.conf"

log() { echo "cluster: $*"; }
die() { echo "cluster: error: $*" >&2; exit 1; }

need_root() { [[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, /etc/hosts, slurmd)"; }

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v nsenter >/dev/null || missing+=(util-linux)
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  log "installing ${missing[*]} (apt-get)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }
pid_in() { [[ -f "$1" ]] && cat "$1" || true; }

write_config() {
  mkdir -p "${DIR}/ctld"
  local node
  for node in "${NODES[@]}"; do mkdir -p "${DIR}/${node}/spool"; done
  cat > "${DIR}/slurm.conf" <<EOF
# Written by tools/cluster.sh: a two-node test cluster on one machine.
ClusterName=sdpo-test
SlurmctldHost=${CTLD_HOST}(${CTLD_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# How long a requeued job waits before it starts again (the old credential's lifetime): 120 s by
# default, 10 here so that the requeue tests do not wait.
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=${DIR}/ctld
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmctldLogFile=${DIR}/slurmctld.log
SlurmdSpoolDir=${DIR}/%n/spool
SlurmdPidFile=${DIR}/%n/slurmd.pid
SlurmdLogFile=${DIR}/%n/slurmd.log
SlurmdParameters=config_overrides
# No cgroup filesystem inside the node namespaces: processes are tracked through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=${KILL_WAIT_S}
InactiveLimit=0
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# The jobs' #SBATCH --gpus-per-node=8 is accepted as written: each node declares 8 GPUs whose
# "device files" are empty files (gres/gpu discards a GPU without File=); nothing in a CPU job
# opens them.
GresTypes=gpu
NodeName=${NODES[0]} NodeAddr=${NET}.11 CPUs=2 RealMemory=16000 Gres=gpu:8 State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=${NET}.12 CPUs=2 RealMemory=16000 Gres=gpu:8 State=UNKNOWN
PartitionName=main Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=${GRACE_S}
PartitionName=urgent Nodes=${NODES[0]},${NODES[1]} MaxTime=INFINITE State=UP PriorityTier=2
EOF
  mkdir -p "${DIR}/gpu"
  touch "${DIR}"/gpu/nvidia{0..7}
  echo "Name=gpu File=${DIR}/gpu/nvidia[0-7]" > "${DIR}/gres.conf"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0  # a munged already answers (ours from an earlier `up`, or the machine's own)
  fi
  [[ -f /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || die "no /etc/munge/munge.key"; chown munge:munge /etc/munge/munge.key; }
  mkdir -p /run/munge "${DIR}/munge" && chown munge:munge /run/munge "${DIR}/munge"
  # munged runs as munge: its pid file goes where that user can write it.
  runuser -u munge -- munged --pid-file="${DIR}/munge/munged.pid" || die "munged did not start"
  local _
  for _ in $(seq 50); do [[ -s "${DIR}/munge/munged.pid" ]] && break; sleep 0.1; done
  [[ -s "${DIR}/munge/munged.pid" ]] || die "munged wrote no pid file (${DIR}/munge/munged.pid)"
  echo owned > "${DIR}/munged.owned"
}

setup_network() {
  if ! ip link show "${BRIDGE}" >/dev/null 2>&1; then
    ip link add "${BRIDGE}" type bridge
    ip addr add "${CTLD_ADDR}/24" dev "${BRIDGE}"
    ip link set "${BRIDGE}" up
  fi
  local k node host_if
  for k in "${!NODES[@]}"; do
    node="${NODES[$k]}"
    host_if="sdpov$((k + 1))"
    [[ -e "/var/run/netns/${node}" ]] || ip netns add "${node}"
    if ! ip link show "${host_if}" >/dev/null 2>&1; then
      ip link add "${host_if}" type veth peer name "${NODE_IF}" netns "${node}"
      ip link set "${host_if}" master "${BRIDGE}"
      ip link set "${host_if}" up
      ip -n "${node}" addr add "${NET}.$((11 + k))/24" dev "${NODE_IF}"
      ip -n "${node}" link set "${NODE_IF}" up
      ip -n "${node}" link set lo up
    fi
    grep -q " ${node} ${HOSTS_TAG}\$" /etc/hosts || echo "${NET}.$((11 + k)) ${node} ${HOSTS_TAG}" >> /etc/hosts
  done
}

start_ctld() {
  alive "$(pid_in "${DIR}/slurmctld.pid")" && return 0
  slurmctld -i || die "slurmctld did not start (${DIR}/slurmctld.log)"
}

start_slurmd() {
  local node
  for node in "${NODES[@]}"; do
    alive "$(pid_in "${DIR}/${node}/slurmd.pid")" && continue
    # `ip netns exec` would remount /sys; nsenter keeps the mounts and only changes the network.
    nsenter --net="/var/run/netns/${node}" unshare --uts \
      sh -c "hostname ${node} && exec slurmd" || die "slurmd on ${node} did not start (${DIR}/${node}/slurmd.log)"
  done
}

wait_idle() {
  local _ state
  for _ in $(seq 120); do
    state="$(sinfo -h -p main -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')"
    if [[ "${state}" == "idle " ]]; then log "up: ${NODES[*]} idle (SLURM_CONF=${SLURM_CONF})"; return 0; fi
    sleep 0.5
  done
  sinfo -N -l >&2 || true
  die "nodes not idle after 60 s (state: ${state:-none}); logs in ${DIR}"
}

up() {
  need_root
  install_packages
  mkdir -p "${DIR}"
  write_config
  start_munge
  setup_network
  start_ctld
  start_slurmd
  wait_idle
}

kill_pid() {  # TERM, then KILL after 10 s
  local pid="$1" _
  alive "${pid}" || return 0
  kill -TERM "${pid}" 2>/dev/null || true
  for _ in $(seq 100); do alive "${pid}" || return 0; sleep 0.1; done
  kill -KILL "${pid}" 2>/dev/null || true
}

down() {
  need_root
  local node k pid
  if [[ -f "${SLURM_CONF}" ]] && alive "$(pid_in "${DIR}/slurmctld.pid")"; then
    scancel --full --signal=KILL --partition=main,urgent 2>/dev/null || true
  fi
  for node in "${NODES[@]}"; do
    kill_pid "$(pid_in "${DIR}/${node}/slurmd.pid")"
    # Job processes a killed slurmd left behind: whatever still runs in the node's namespace.
    if [[ -e "/var/run/netns/${node}" ]]; then
      for pid in $(ip netns pids "${node}" 2>/dev/null); do kill -KILL "${pid}" 2>/dev/null || true; done
    fi
  done
  kill_pid "$(pid_in "${DIR}/slurmctld.pid")"
  # Daemons of this cluster whose pid file is gone (an earlier run's state removed under them).
  for pid in $(pgrep -x 'slurmctld|slurmd' || true); do
    if tr '\0' '\n' < "/proc/${pid}/environ" 2>/dev/null | grep -qx "SLURM_CONF=${SLURM_CONF}"; then
      kill_pid "${pid}"
    fi
  done
  if [[ -f "${DIR}/munged.owned" ]]; then
    kill_pid "$(pid_in "${DIR}/munge/munged.pid")"
    rm -f "${DIR}/munged.owned"
  fi
  for k in "${!NODES[@]}"; do
    ip link del "sdpov$((k + 1))" 2>/dev/null || true
    ip netns del "${NODES[$k]}" 2>/dev/null || true
  done
  ip link del "${BRIDGE}" 2>/dev/null || true
  if grep -q "${HOSTS_TAG}\$" /etc/hosts; then
    # /etc/hosts may be a bind mount: rewrite it in place rather than replace the file.
    local kept; kept="$(grep -v "${HOSTS_TAG}\$" /etc/hosts)"
    printf '%s\n' "${kept}" > /etc/hosts
  fi
  rm -rf "${DIR}"
  log "down: no daemon, namespace, link or host entry of the test cluster left"
}

status() {
  local node
  echo "slurmctld: $(alive "$(pid_in "${DIR}/slurmctld.pid")" && echo "pid $(cat "${DIR}/slurmctld.pid")" || echo "not running")"
  for node in "${NODES[@]}"; do
    echo "slurmd ${node}: $(alive "$(pid_in "${DIR}/${node}/slurmd.pid")" && echo "pid $(cat "${DIR}/${node}/slurmd.pid")" || echo "not running")"
  done
  [[ -f "${SLURM_CONF}" ]] && sinfo || true
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  env) echo "export SLURM_CONF=${SLURM_CONF}" ;;
  *) echo "usage: bash tools/cluster.sh up|down|status|env" >&2; exit 2 ;;
esac
