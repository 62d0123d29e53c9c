#!/usr/bin/env bash
# Start a throw-away single-node Slurm cluster on this machine (as root), for CI and for trying
# the Slurm profile: munged, slurmctld and slurmd from Debian's packages, installed if missing.
# Every daemon writes a pid file under $STATE; tests/slurm/down.sh stops exactly those.
#   STATE=/tmp/imgclf-slurm tests/slurm/up.sh
set -euo pipefail
STATE="${STATE:-/tmp/imgclf-slurm}"
CONF=/etc/slurm/slurm.conf   # the plugin's job step drops SLURM_CONF: only this path works
MARK="# throw-away cluster of tests/slurm/up.sh"

[ "$(id -u)" = 0 ] || { echo "tests/slurm/up.sh must run as root" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "$CONF exists and is not ours: refusing to replace a real cluster's configuration" >&2
    exit 1
fi

host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p "$STATE"/{ctld,spool,munge} /etc/slurm /run/munge
chmod 755 "$STATE" /run/munge "$STATE/munge"   # munged refuses to start otherwise
dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$STATE/munge/munge.key"

cat > "$CONF" <<CONF
$MARK
ClusterName=imgclf-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# no systemd, no cgroups here
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# no slurmdbd: the workflow's status checks use squeue, which must still see finished jobs
MinJobAge=300
ReturnToService=2
MpiDefault=none
# one pretend GPU so that rules asking for a GPU schedule; the job sees no CUDA device
GresTypes=gpu
NodeName=$host CPUs=$cpus RealMemory=$mem_mb Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
cat > /etc/slurm/gres.conf <<CONF
$MARK
NodeName=$host Name=gpu File=/dev/null
CONF

munged --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munged.pid" \
       --log-file="$STATE/munged.log" --seed-file="$STATE/munge/munged.seed"
slurmctld
slurmd

for _ in $(seq 1 60); do
    state=$(sinfo -h -o %T 2>/dev/null | head -n1 || true)
    if [ "$state" = idle ]; then
        echo "Slurm cluster up: node $host ($cpus CPUs, ${mem_mb} MB, 1 pretend GPU), partition debug"
        exit 0
    fi
    sleep 0.5
done
echo "Slurm cluster did not become idle (state: ${state:-none}); logs in $STATE" >&2
exit 1
