#!/usr/bin/env bash
# A single-node, CPU-only Slurm on this machine (Debian/Ubuntu packages slurmctld, slurmd,
# munge), for `areal-hex deploy --target slurm` and the tests marked `slurm`.
#
#   scripts/local_slurm.sh          # install if missing (apt), configure, start, wait idle
#   scripts/local_slurm.sh stop     # stop slurmd, slurmctld and munged
#
# Idempotent: daemons already answering are left alone. The node is the machine's real
# CPUs and memory (`slurmd -C`), no GRES; process tracking without cgroups
# (proctrack/linuxproc, task/none), so it also runs inside containers. Cores may be shared
# by up to 4 jobs (OverSubscribe=FORCE:4): the components of one heterogeneous job need
# more cores than a small machine has. Exits 0 when the node is idle, 1 otherwise.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo -n"
fi
CONF_DIR=/etc/slurm
STATE=/var/lib/slurm
LOGS=/var/log/slurm
NODE="$(hostname -s)"

log() { echo "local_slurm: $*" >&2; }

stop() {
  for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      $SUDO kill "$(cat "$pidfile")"
      log "stopped $(basename "$pidfile" .pid)"
    fi
  done
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v munged >/dev/null && command -v sbatch >/dev/null; then
    return 0
  fi
  if ! command -v apt-get >/dev/null; then
    log "slurmctld/slurmd/munge are not installed and apt-get is not available"
    return 1
  fi
  log "installing slurmctld slurmd slurm-client munge (apt)"
  local pkgs=(slurmctld slurmd slurm-client munge)
  local apt=($SUDO env DEBIAN_FRONTEND=noninteractive apt-get)
  "${apt[@]}" install -y --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 || {
    "${apt[@]}" update >/dev/null && "${apt[@]}" install -y --no-install-recommends "${pkgs[@]}" >/dev/null
  }
}

write_config() {
  local hw
  # "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1
  # RealMemory=24105": the hardware as slurmd sees it.
  hw="$(slurmd -C | head -n 1)"
  $SUDO mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS"
  $SUDO chown -R slurm:slurm "$STATE" "$LOGS"
  $SUDO tee "$CONF_DIR/slurm.conf.new" >/dev/null <<EOF
# Written by areal-hex scripts/local_slurm.sh: one CPU-only node, no accounting.
ClusterName=areal-local
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
KillWait=30
${hw} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  if cmp -s "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"; then
    $SUDO rm -f "$CONF_DIR/slurm.conf.new"
    return 0
  fi
  $SUDO mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
  if scontrol ping 2>/dev/null | grep -q "is UP"; then
    $SUDO scontrol reconfigure && log "slurm.conf changed: reconfigured"
  fi
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  $SUDO mkdir -p /run/munge
  $SUDO chown munge:munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    $SUDO mungekey --create --force
    $SUDO chown munge:munge /etc/munge/munge.key
  fi
  $SUDO runuser -u munge -- /usr/sbin/munged
  log "started munged"
}

start_daemons() {
  if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
    $SUDO /usr/sbin/slurmctld
    log "started slurmctld"
  fi
  if ! { [ -f /run/slurmd.pid ] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null; }; then
    $SUDO /usr/sbin/slurmd -N "$NODE"
    log "started slurmd"
  fi
}

wait_idle() {
  local state=""
  for _ in $(seq 1 60); do
    state="$(sinfo -h -N -n "$NODE" -o %t 2>/dev/null | head -n 1 || true)"
    case "$state" in
      idle | mix | alloc) log "node $NODE is $state"; return 0 ;;
      down* | drain* | drng*) $SUDO scontrol update NodeName="$NODE" State=RESUME || true ;;
    esac
    sleep 1
  done
  log "node $NODE not idle after 60 s (state: ${state:-none}); see $LOGS"
  return 1
}

case "${1:-start}" in
  stop) stop ;;
  start)
    install_packages
    write_config
    start_munge
    start_daemons
    wait_idle
    ;;
  *) echo "usage: $0 [start|stop]" >&2; exit 2 ;;
esac
