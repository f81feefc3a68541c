#!/usr/bin/env bash
# Single-host Slurm 22.05 (Debian's slurmctld, slurmd, slurm-client, munge) for CI and tests.
# This host is the whole cluster: one partition `guard`, one node named `hostname -s`.
#
#   deploy/slurm/slurm.sh start    install the packages if missing (apt-get), write slurm.conf,
#                                  start munged (as munge), slurmctld and slurmd (as root), wait
#                                  until the node is up; prints `export` lines for the tests:
#                                    eval "$(deploy/slurm/slurm.sh start)"
#   deploy/slurm/slurm.sh stop     stop the daemons this script started (pid files) and drop state
#   deploy/slurm/slurm.sh status   running or not, and the node's state
#
# The node declares GUARD_CI_SLURM_GPUS (default 2) GPUs as GRES (GresTypes=gpu, `Gres=gpu:N`,
# gres.conf `File=` device files: slurmd drops a file-less GPU), so that the sweep's
# `srun --gres=gpu:N --exclusive` is scheduled by the real slurmctld, and the sweep on this
# GPU-less host is judged against N expected GPUs (it must not pass).
# Device cgroups, as on a GPU cluster: where the cgroup v1 devices hierarchy is writable and
# mknod works (checked on this kind of machine), the GPU files are character devices with
# NVIDIA's major number (195:i, no driver behind them) and Slurm runs ProctrackType=
# proctrack/cgroup, TaskPlugin=task/cgroup with cgroup.conf ConstrainDevices=yes: a job opens
# only the GPUs it was given (another one's open fails EPERM; its own ENXIO, no driver).
# Elsewhere (cgroup v2 only, no mknod) or with GUARD_CI_SLURM_CGROUP=no it falls back to
# proctrack/linuxproc, task/none, no cgroup.conf (22.05 has no CgroupPlugin=disabled: slurmd
# would fail) and /dev/null links, and writes why to $dir/cgroup.state.
# Slurm's ports are fixed (6817/6818), so there is one such cluster per host: its files live in
# GUARD_CI_SLURM_DIR (default /var/tmp/guard-slurm), whichever checkout started it.
# Environment: GUARD_CI_SLURM_DIR, GUARD_CI_SLURM_START_TIMEOUT (s, default 60),
# GUARD_CI_SLURM_CGROUP (auto: device cgroups where they work; no: never).
set -euo pipefail

dir="${GUARD_CI_SLURM_DIR:-/var/tmp/guard-slurm}"
conf="$dir/slurm.conf"
node="$(hostname -s)"
gpus="${GUARD_CI_SLURM_GPUS:-2}"
log() { echo "slurm.sh: $*" >&2; }

install_packages() {
  local missing=()
  for bin in slurmctld slurmd scontrol munged; do
    command -v "$bin" >/dev/null || missing+=("$bin")
  done
  [[ ${#missing[@]} -eq 0 ]] && return
  [[ $(id -u) -eq 0 ]] || { log "missing ${missing[*]}; run as root to install them"; exit 1; }
  log "installing slurmctld slurmd slurm-client munge from Debian (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >&2
}

# GPU device files, and whether Slurm constrains devices with cgroups: "on" or "off: why"
gpu_devices() {
  local i probe=/sys/fs/cgroup/devices/guard-slurm-probe.$$
  rm -rf "$dir/dev"; mkdir -p "$dir/dev"
  if [[ ${GUARD_CI_SLURM_CGROUP:-auto} == no ]]; then
    cgroup="off: GUARD_CI_SLURM_CGROUP=no"
  elif ! mknod "$dir/dev/nvidia0" c 195 0 2>/dev/null; then
    cgroup="off: mknod is not allowed here"
  elif ! mkdir "$probe" 2>/dev/null || ! rmdir "$probe"; then
    cgroup="off: no writable cgroup v1 devices hierarchy at /sys/fs/cgroup/devices"
  else
    cgroup="on"
  fi
  rm -f "$dir/dev/nvidia0"
  for ((i = 0; i < gpus; i++)); do
    if [[ $cgroup == on ]]; then mknod "$dir/dev/nvidia$i" c 195 "$i"
    else ln -sfn /dev/null "$dir/dev/nvidia$i"; fi
  done
  echo "$cgroup" > "$dir/cgroup.state"
  [[ $cgroup == on ]] || log "device cgroups $cgroup"
}

write_conf() {
  local cpus mem proctrack=proctrack/linuxproc task=task/none
  cpus="$(nproc)"
  mem="$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  gpu_devices
  rm -f "$dir/cgroup.conf"
  if [[ $cgroup == on ]]; then
    proctrack=proctrack/cgroup task=task/cgroup
    printf '%s\n' "CgroupPlugin=cgroup/v1" "CgroupMountpoint=/sys/fs/cgroup" \
      "ConstrainDevices=yes" "ConstrainCores=no" "ConstrainRAMSpace=no" > "$dir/cgroup.conf"
  fi
  cat > "$conf" <<CONF
# written by deploy/slurm/slurm.sh: a one-host cluster for Guard's tests
ClusterName=guard-ci
SlurmctldHost=$node
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=$proctrack
TaskPlugin=$task
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
GresTypes=gpu
JobRequeue=1
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=60
KillWait=5
NodeName=$node CPUs=$cpus RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN
PartitionName=guard Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
  # slurmd reads gres.conf (and cgroup.conf) next to slurm.conf; gres/gpu wants a device file
  # per GPU (it drops `Count=`-only GPUs): gpu_devices made them
  echo "NodeName=$node Name=gpu File=$dir/dev/nvidia[0-$((gpus - 1))]" > "$dir/gres.conf"
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return  # a munged already answers
  [[ -f /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key >&2
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/guard-munged.pid >&2
  cp /run/munge/guard-munged.pid "$dir/munged.pid"
  munge -n | unmunge >/dev/null || { log "munged does not answer: see /var/log/munge/munged.log"; exit 1; }
}

exports() {
  echo "export SLURM_CONF=$conf"
  echo "export GUARD_CI_SLURM_NODE=$node"
  echo "export GUARD_CI_SLURM_GPUS=$gpus"
  echo "export GUARD_CI_SLURM_CGROUP_STATE='$(cat "$dir/cgroup.state" 2>/dev/null)'"
}

node_state() { SLURM_CONF="$conf" sinfo -h -n "$node" -o %T 2>/dev/null | head -1; }

start() {
  install_packages
  if pid_alive "$dir/slurmctld.pid" && pid_alive "$dir/slurmd.pid"; then
    log "already running (node $node: $(node_state))"; exports; return
  fi
  mkdir -p "$dir" && chmod 0755 "$dir"
  write_conf
  start_munge
  pid_alive "$dir/slurmctld.pid" || slurmctld -f "$conf" >&2
  pid_alive "$dir/slurmd.pid" || slurmd -f "$conf" >&2
  local deadline=$((SECONDS + ${GUARD_CI_SLURM_START_TIMEOUT:-60})) state=""
  while ((SECONDS < deadline)); do
    state="$(node_state)"
    case "$state" in idle|mixed|allocated) log "node $node is $state"; exports; return ;; esac
    sleep 0.5
  done
  log "node $node did not come up within ${GUARD_CI_SLURM_START_TIMEOUT:-60} s (state: ${state:-none});"
  log "see $dir/log/slurmctld.log and $dir/log/slurmd.log"
  exit 1
}

stop_pid() {
  local file="$1" pid
  pid_alive "$file" || { rm -f "$file"; return; }
  pid="$(cat "$file")"
  kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$file"
}

stop() {
  stop_pid "$dir/slurmd.pid"
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munged.pid"
  rm -rf "$dir/state" "$dir/spool"
  log "stopped"
}

status() {
  if pid_alive "$dir/slurmctld.pid" && pid_alive "$dir/slurmd.pid"; then
    echo "running: node $node is $(node_state) (SLURM_CONF=$conf)"
  else
    echo "not running"; return 1
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
