#!/usr/bin/env bash
# Stop exactly the daemons tests/slurm/up.sh started, by their pid files (never by name; a pid
# whose process is not the daemon its file names is left alone), and remove what it made: the
# node namespaces, the bridge, its /etc/hosts lines and configuration.
set -uo pipefail
source "$(dirname "$0")/daemons.sh"
STATE="${STATE:-/tmp/imgclf-slurm}"
MARK="# throw-away cluster of tests/slurm/up.sh"

stop() {  # pid file
    local pid
    if pid=$(running_pid "$1"); then
        kill "$pid"
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$1"
}

for pidfile in "$STATE"/slurmd-*.pid; do stop "$pidfile"; done
for name in slurmctld slurmdbd mariadbd munged; do stop "$STATE/$name.pid"; done
if [ -f "$STATE/netns" ]; then
    # Whatever still runs in a node (a job step outlives slurmd) is ours and is killed: it would
    # keep the namespace, and its veth, alive after `ip netns del`, and the next up.sh would
    # stop at "File exists".
    while read -r ns; do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null
        ip netns del "$ns" 2>/dev/null
    done < "$STATE/netns"
fi
[ -f "$STATE/bridge" ] && ip link del "$(cat "$STATE/bridge")" 2>/dev/null
if grep -qF "$MARK" /etc/hosts; then
    # /etc/hosts may be a bind mount: rewrite it in place rather than replace it
    kept=$(grep -vF "$MARK" /etc/hosts)
    printf '%s\n' "$kept" > /etc/hosts
fi
# each slurmd's cgroup trees (/sys/fs/cgroup/<controller>/slurm_<node>), emptied bottom-up
if [ -f "$STATE/netns" ]; then
    while read -r ns; do
        for tree in /sys/fs/cgroup/*/"slurm_$ns"; do
            [ -d "$tree" ] && find "$tree" -depth -type d -exec rmdir {} + 2>/dev/null
        done
    done < "$STATE/netns"
fi
for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/slurmdbd.conf \
         /etc/slurm/cgroup.conf; do
    [ -f "$f" ] && grep -qF "$MARK" "$f" && rm -f "$f"
done
rm -rf "$STATE"
echo "Slurm cluster down"
