#!/usr/bin/env bash
# A real two-node SLURM cluster on one machine, for testing launch/slurm.sbatch: Debian's
# slurm-wlm (slurmctld, slurmd) and munge, one slurmd per "host" (a network namespace with its
# own hostname, as tests/multihost.py makes them), the controller on the first.
#
#   launch/slurm-testcluster.sh start STATE_DIR NETNS0:NAME0:ADDR0 NETNS1:NAME1:ADDR1
#   SLURM_CONF=STATE_DIR/slurm.conf ip netns exec NETNS0 sbatch --nodes=2 launch/slurm.sbatch ...
#   launch/slurm-testcluster.sh stop STATE_DIR
#
# Everything the cluster writes lives in STATE_DIR (config, munge key and socket, spool, logs,
# pid files with %n per node); it uses the namespaces' addresses only. Needs root. Installs
# slurm-wlm and munge with apt-get when they are missing.
set -euo pipefail
cmd=${1:?usage: $0 start|stop STATE_DIR [NETNS:NAME:ADDR x2]}
state=${2:?usage: $0 start|stop STATE_DIR [NETNS:NAME:ADDR x2]}

stop() {
  # Only what this cluster started: the pids in its own pid files, then its namespaces' daemons.
  for f in "$state"/*.pid; do
    [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null || true
  done
  sleep 0.5
  for f in "$state"/*.pid; do
    [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
}

if [ "$cmd" = stop ]; then
  stop
  exit 0
fi
[ "$cmd" = start ] || { echo "unknown command $cmd: start or stop" >&2; exit 2; }
IFS=: read -r ns0 name0 addr0 <<<"${3:?NETNS0:NAME0:ADDR0}"
IFS=: read -r ns1 name1 addr1 <<<"${4:?NETNS1:NAME1:ADDR1}"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
fi

mkdir -p "$state"/ctld "$state/spool/$name0" "$state/spool/$name1"
chmod 755 "$state"
# munge: a key and a socket of this cluster's own (no system munged needed, none disturbed).
dd if=/dev/urandom of="$state/munge.key" bs=1024 count=1 status=none
chmod 400 "$state/munge.key"
munged --force --socket="$state/munge.sock" --key-file="$state/munge.key" \
  --pid-file="$state/munged.pid" --log-file="$state/munged.log" --seed-file="$state/munged.seed"

cpus=$(nproc)
cat >"$state/slurm.conf" <<EOF
ClusterName=mpotest
SlurmctldHost=$name0($addr0)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge.sock
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=30
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$name0 NodeAddr=$addr0 CPUs=$cpus State=UNKNOWN
NodeName=$name1 NodeAddr=$addr1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
# Nothing here uses cgroups (proctrack/linuxproc, task/none); naming the v1 plugin keeps
# slurmd's start-up from autodetecting, which fails inside a namespace's fresh /sys.
echo "CgroupPlugin=cgroup/v1" >"$state/cgroup.conf"
export SLURM_CONF="$state/slurm.conf"

# Each daemon runs in its host's namespace under its host's hostname (slurmd finds its
# NodeName from the hostname) and daemonises itself; its pid file is in $state.
on() {
  local ns=$1 name=$2; shift 2
  ip netns exec "$ns" unshare --uts sh -c "hostname $name && exec \"\$@\"" sh "$@"
}
on "$ns0" "$name0" slurmctld -i -f "$SLURM_CONF"
on "$ns0" "$name0" slurmd -f "$SLURM_CONF"
on "$ns1" "$name1" slurmd -f "$SLURM_CONF"

# Up when both nodes are idle (slurmd registered with the controller).
for _ in $(seq 1 60); do
  idle=$(ip netns exec "$ns0" sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)
  [ "$idle" = 2 ] && { echo "slurm test cluster up: $name0 ($addr0), $name1 ($addr1); SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.5
done
echo "slurm test cluster did not come up; logs in $state:" >&2
tail -n 20 "$state"/*.log >&2 || true
exit 1
