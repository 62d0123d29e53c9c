#!/usr/bin/env bash
# Stop exactly the daemons tests/slurm/up.sh started, by their pid files (never by name),
# and remove the configuration it wrote.
set -uo pipefail
STATE="${STATE:-/tmp/imgclf-slurm}"
MARK="# throw-away cluster of tests/slurm/up.sh"

for name in slurmd slurmctld munged; do
    pidfile="$STATE/$name.pid"
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile"
done
for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf; do
    [ -f "$f" ] && grep -qF "$MARK" "$f" && rm -f "$f"
done
rm -rf "$STATE"
echo "Slurm cluster down"
