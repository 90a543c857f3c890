#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying and testing hydra/launcher=slurm_cpu.
#
#   sudo scripts/slurm_cluster.sh          # bring it up (idempotent: daemons already up are kept)
#   sudo scripts/slurm_cluster.sh stop     # stop the daemons this script started
#
# Needs root and Debian's packages: apt-get install -y slurm-wlm munge
# The node gets this machine's CPUs and memory, no GPUs (no gres), in one partition `cpu`.
# Accounting is off (no slurmdbd), as on many small clusters: sacct answers with an error.
# Exit codes: 0 the node is idle, 3 a requirement is missing (the reason on one line), 1 it failed.
set -euo pipefail

STATE=${NORMLAB_SLURM_STATE:-/var/spool/normlab-slurm}
CONF=/etc/slurm/slurm.conf

missing() { echo "slurm_cluster: $*" >&2; exit 3; }

if [[ ${1:-} == stop ]]; then
    for pidfile in "$STATE"/slurmd.pid "$STATE"/slurmctld.pid "$STATE"/munged.pid; do
        [[ -s $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    exit 0
fi

[[ $(id -u) == 0 ]] || missing "needs root (the daemons run as root)"
for cmd in munged slurmctld slurmd sinfo sbatch; do
    command -v "$cmd" >/dev/null || [[ -x /usr/sbin/$cmd ]] || missing "$cmd not found: apt-get install -y slurm-wlm munge"
done
export PATH=$PATH:/usr/sbin

node=$(hostname -s)
cpus=$(nproc)
# The node's CPU layout as slurmd sees it (CPUs alone would make SLURM count one core).
layout=$(slurmd -C | head -1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
[[ $layout == *CPUs=* ]] || layout="CPUs=$cpus "
# SLURM refuses a node that reports less memory than RealMemory: leave it some slack.
memory=$(( $(free -m | awk '/^Mem:/ {print $2}') * 9 / 10 ))
mkdir -p "$STATE"/slurmctld "$STATE"/slurmd /etc/slurm /run/munge /var/log/munge /var/lib/munge

conf_text="# Written by normlab's scripts/slurm_cluster.sh: one node, no accounting.
ClusterName=normlab
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
MinJobAge=60
KillWait=10
InactiveLimit=0
NodeName=$node ${layout}RealMemory=$memory State=UNKNOWN
PartitionName=cpu Nodes=$node Default=YES MaxTime=INFINITE State=UP"

running() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$conf_text" ]]; then
    echo "$conf_text" > "$CONF"
    # A changed config needs restarted daemons.
    for pidfile in "$STATE"/slurmd.pid "$STATE"/slurmctld.pid; do
        if running "$pidfile"; then kill "$(cat "$pidfile")"; sleep 1; fi
    done
fi

if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown root:root /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
chmod 755 /run/munge
if ! munge -n >/dev/null 2>&1; then
    munged --force --pid-file="$STATE"/munged.pid 2>/dev/null || munged --force
fi
running "$STATE"/slurmctld.pid || slurmctld
running "$STATE"/slurmd.pid || slurmd

for _ in $(seq 100); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    case $state in
        idle | mixed | allocated) echo "slurm_cluster: node $node is $state (partition cpu, $cpus CPUs, ${memory} MB)"; exit 0 ;;
        down* | drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
done
echo "slurm_cluster: the node did not become idle; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
exit 1
