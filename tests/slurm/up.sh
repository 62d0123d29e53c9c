#!/usr/bin/env bash
# Start a throw-away multi-node Slurm cluster on this machine (as root), for CI and for trying
# the Slurm profile. Each compute node is a slurmd in its own network namespace (and host name)
# on a private bridge, as a real node is its own host on the cluster network; the nodes share
# this machine's file system as a real cluster shares its parallel file system. The controller,
# slurmdbd with a local MariaDB for job accounting (sacct), and munged run in the root namespace.
# Debian's packages, installed if missing. Every daemon writes a pid file under $STATE;
# tests/slurm/down.sh stops exactly those, and removes the namespaces, bridge and hosts lines.
# The NODES compute nodes form partition debug, the default: CPU nodes without GPUs, where a
# job that asks for a GPU is refused, as on a real CPU partition. Two more form partition spare,
# for a test that sets one of them down while a job that needs both waits there, and the other
# tests' jobs run on in partition debug (a node in both partitions would be held for the job
# that waits). Two nodes of partition gpu carry typed GPUs, 8 `a100`, 4 `a10g` and 4
# `Tesla_V100` (a type with capitals, which Slurm compares case-sensitively) each, and the CPUs
# and memory of a p4 node: they take no job (nothing here has a GPU), but slurmctld accepts or
# refuses the sbatch line of each GPU job against them (`sbatch --test-only`). Partition short
# holds the debug nodes under a MaxTime of 60 minutes, as a site's shorter partition would.
# Every job is confined as on a production cluster (task/cgroup, cgroup v1): it sees only the
# CPUs it asked for and is killed when it uses more memory than it asked for.
#   STATE=/tmp/imgclf-slurm NODES=2 tests/slurm/up.sh
set -euo pipefail
source "$(dirname "$0")/daemons.sh"
STATE="${STATE:-/tmp/imgclf-slurm}"
NODES="${NODES:-2}"
ALL=$((NODES + 2))
SPARE="imgclf-n[$((NODES + 1))-$ALL]"
GPU_NODES=(imgclf-g1 imgclf-g2)
GPU_GRES="gpu:a100:8,gpu:a10g:4,gpu:Tesla_V100:4"
CONF=/etc/slurm/slurm.conf   # the plugin's job step drops SLURM_CONF: only this path works
DBD_CONF=/etc/slurm/slurmdbd.conf
MARK="# throw-away cluster of tests/slurm/up.sh"
NET=10.77.0          # the private cluster network: controller .1, node i at .(10+i)
BRIDGE=imgclf-br0
DB_PORT=3307         # MariaDB on 127.0.0.1 only, beside any server on the default port

[ "$(id -u)" = 0 ] || { echo "tests/slurm/up.sh must run as root" >&2; exit 1; }
need=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client slurmdbd:slurmdbd \
            munged:munge mariadbd:mariadb-server ip:iproute2 unshare:util-linux; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
for f in "$CONF" "$DBD_CONF"; do
    if [ -f "$f" ] && ! grep -qF "$MARK" "$f"; then
        echo "$f exists and is not ours: refusing to replace a real cluster's configuration" >&2
        exit 1
    fi
done
if [ -e "$STATE" ]; then
    # left behind by a machine that stopped (or was restored) with the cluster up: none of its
    # daemons runs, so tests/slurm/down.sh clears what is left; a running one is never touched
    alive=""
    for pidfile in "$STATE"/*.pid; do
        running_pid "$pidfile" >/dev/null && alive+=" $(basename "$pidfile" .pid)"
    done
    if [ -n "$alive" ]; then
        echo "$STATE exists and its daemons run ($alive): a test cluster is up; run tests/slurm/down.sh" >&2
        exit 1
    fi
    echo "$STATE is left from a test cluster whose daemons are gone: clearing it" >&2
    STATE="$STATE" "$(dirname "$0")/down.sh"
fi

host=$(hostname -s)
cpus=$(nproc)
# Each node offers the whole machine (the nodes share its cores and memory), less 1 GB
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p "$STATE"/{ctld,spool,munge,mysql} /etc/slurm /run/munge
chmod 755 "$STATE" /run/munge "$STATE/munge"   # munged refuses to start otherwise

# --- the cluster network: a bridge, and per node a namespace with a veth pair ---------------
ip link add "$BRIDGE" type bridge
ip addr add "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
echo "$BRIDGE" > "$STATE/bridge"
nodes=()
# node i at .(10+i); the GPU nodes imgclf-g1, imgclf-g2 at .31, .32
for i in $(seq 1 "$ALL") 21 22; do
    node=imgclf-n$i
    [ "$i" -gt 20 ] && node=imgclf-g$((i - 20))
    addr=$NET.$((10 + i))
    nodes+=("$node")
    ip netns add "$node"
    echo "$node" >> "$STATE/netns"
    # a veth of this name left by a cluster whose teardown did not finish is removed first
    ip link del "imgclf-v$i" 2>/dev/null || true
    ip link add "imgclf-v$i" type veth peer name eth0 netns "$node"
    ip link set "imgclf-v$i" master "$BRIDGE" up
    ip -n "$node" addr add "$addr/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" link set lo up
    echo "$addr $node $MARK" >> /etc/hosts
    echo "$node $addr" >> "$STATE/addresses"
done

# --- munge, MariaDB, slurmdbd --------------------------------------------------------------
dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$STATE/munge/munge.key"
munged --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munged.pid" \
       --log-file="$STATE/munged.log" --seed-file="$STATE/munge/munged.seed"

mariadb-install-db --no-defaults --datadir="$STATE/mysql" --user=root --skip-test-db \
    > "$STATE/mariadb-install.log" 2>&1
mariadbd --no-defaults --datadir="$STATE/mysql" --user=root --bind-address=127.0.0.1 \
    --port=$DB_PORT --socket="$STATE/mysql.sock" --pid-file="$STATE/mariadbd.pid" \
    --log-error="$STATE/mariadbd.log" --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
for _ in $(seq 1 60); do [ -S "$STATE/mysql.sock" ] && break; sleep 0.5; done
db_pass=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
mariadb --no-defaults --socket="$STATE/mysql.sock" -u root -e "
    CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_pass';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

cat > "$DBD_CONF" <<CONF
$MARK
AuthType=auth/munge
DbdHost=$host
DbdAddr=$NET.1
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=slurm_acct_db
CONF
chmod 600 "$DBD_CONF"
slurmdbd

# --- slurmctld and one slurmd per node namespace --------------------------------------------
node_lines=""
while read -r node addr; do
    case "$node" in
        imgclf-g*) shape="CPUs=96 RealMemory=1100000 Gres=$GPU_GRES" ;;  # a p4 node's
        *) shape="CPUs=$cpus RealMemory=$mem_mb" ;;
    esac
    node_lines+="NodeName=$node NodeAddr=$addr $shape State=UNKNOWN
"
done < "$STATE/addresses"
cat > "$CONF" <<CONF
$MARK
ClusterName=imgclf-ci
SlurmctldHost=$host($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits this long before it starts again (Slurm's default 120 s); it is also how
# long a job step's credential is valid, which a step on this machine uses within a second
AuthInfo=cred_expire=15
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
# several slurmd on one machine: their own spool, pid and log files (%n: the node name)
SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/slurmd-%n.log
# job accounting: sacct answers from slurmdbd, the plugin's default status path
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$NET.1
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
# jobs confined to the CPUs and memory they asked for (cgroup.conf), as on production
# clusters; no systemd here
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# finished jobs stay in squeue for the status path of clusters without accounting
MinJobAge=300
# the main scheduling loop every 5 s (Slurm's default 60 s): a requeued job whose wait is over
# starts then, where no event would start it sooner
SchedulerParameters=sched_interval=5
# a job asking for more than its partition allows (a time above its MaxTime) is refused when it
# is submitted, as production sites refuse it, rather than left pending for good
EnforcePartLimits=ALL
# a node set DOWN by hand stays down until "scontrol update ... state=resume"
ReturnToService=1
# a cancelled or failed step's tasks get SIGKILL 10 s after SIGTERM (Slurm's default is 30)
KillWait=10
MpiDefault=none
# The GPU nodes' slurmd reports the CPUs, memory and GPUs configured here, not this machine's
GresTypes=gpu
SlurmdParameters=config_overrides
${node_lines}PartitionName=debug Nodes=imgclf-n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
PartitionName=spare Nodes=$SPARE MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=imgclf-g[1-2] MaxTime=INFINITE State=UP
PartitionName=short Nodes=imgclf-n[1-$NODES] MaxTime=60 State=UP
CONF
cat > /etc/slurm/cgroup.conf <<CONF
$MARK
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=yes
ConstrainRAMSpace=yes
CONF
# Each pretend GPU a character device of its own, as Slurm counts a node's GPUs by their files:
# copies of /dev/null, which no job here opens
mkdir -p "$STATE/dev"
for i in $(seq 0 15); do mknod "$STATE/dev/gpu$i" c 1 3; done
cat > /etc/slurm/gres.conf <<CONF
$MARK
AutoDetect=off
NodeName=imgclf-g[1-2] Name=gpu Type=a100 File=$STATE/dev/gpu[0-7]
NodeName=imgclf-g[1-2] Name=gpu Type=a10g File=$STATE/dev/gpu[8-11]
NodeName=imgclf-g[1-2] Name=gpu Type=Tesla_V100 File=$STATE/dev/gpu[12-15]
CONF

for _ in $(seq 1 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
sacctmgr -i add cluster imgclf-ci >/dev/null
sacctmgr -i add account demo Description=demo Organization=imgclf >/dev/null
sacctmgr -i add user root DefaultAccount=demo >/dev/null
slurmctld
for node in "${nodes[@]}"; do
    mkdir -p "$STATE/spool/$node"
    # its own network and host name (UTS namespace: the ranks' gethostname()); nsenter, not
    # `ip netns exec`, which would remount /sys without the cgroup file system slurmd reads
    nsenter --net="/run/netns/$node" unshare --uts sh -c "hostname $node && exec slurmd -N $node"
done

for _ in $(seq 1 120); do
    idle=$(sinfo -h -N -o "%N %T" 2>/dev/null | sort -u | awk '$2 == "idle"' | wc -l)
    if [ "$idle" = "${#nodes[@]}" ]; then
        echo "Slurm cluster up: nodes ${nodes[*]} on $NET.0/24, partitions debug" \
             "(imgclf-n[1-$NODES], $cpus CPUs, ${mem_mb} MB, no GPU), spare ($SPARE) and gpu" \
             "(${GPU_NODES[*]}: $GPU_GRES, 96 CPUs, no job runs there), short (the debug nodes," \
             "MaxTime 60 minutes), jobs confined by cgroups," \
             "accounting by slurmdbd (account demo); state in $STATE"
        exit 0
    fi
    sleep 0.5
done
echo "Slurm nodes did not become idle: $(sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')logs in $STATE" >&2
exit 1
