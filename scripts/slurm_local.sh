#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd on localhost, Debian's
# slurm-wlm and munge), started unattended, then a command run through it:
#
#   scripts/slurm_local.sh srun -n 2 build/examples/train_gpt --mode full --steps 20
#   scripts/slurm_local.sh stop
#
# The cluster's state lives under $FLATSHARD_CACHE/slurm (configuration, spool, logs).
# It needs root (slurmd runs jobs as their user and must own its spool) and installs
# slurm-wlm and munge when they are missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/env.sh"
dir="$FLATSHARD_CACHE/slurm"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

stop() {
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  pkill -x munged 2>/dev/null || true
}
if [[ "${1:-}" == stop ]]; then
  stop
  exit 0
fi
[[ $(id -u) -eq 0 ]] || { echo "slurm_local.sh: run as root (slurmd starts jobs as their user)" >&2; exit 2; }

for p in slurm-wlm munge; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge
    break
  fi
done

mkdir -p "$dir/spool/ctld" "$dir/spool/d" "$dir/log" /run/munge
host="$(hostname -s)"
cpus="$(nproc)"
mem_mib="$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))"
cat >"$conf" <<EOF
ClusterName=flatshard
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
# cgroup.conf is read even with the plugins above off; an empty one keeps slurmd quiet.
: >"$dir/cgroup.conf"

stop
chown -R munge: /run/munge 2>/dev/null || true
munged --force
slurmctld -f "$conf"
slurmd -f "$conf"
for _ in $(seq 1 60); do
  if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then break; fi
  sleep 0.5
done
sinfo -h -o '%N %T %c CPUs' || true
sinfo -h -o '%T' | grep -qE '^(idle|mixed|allocated)' ||
  { echo "slurm_local.sh: the node did not come up; see $dir/log" >&2; exit 1; }
[[ $# -eq 0 ]] || "$@"
