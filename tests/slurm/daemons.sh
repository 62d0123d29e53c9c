# Sourced by tests/slurm/up.sh and down.sh: a test cluster's daemons are known by their pid
# files under $STATE (slurmctld.pid, slurmd-imgclf-n1.pid, munged.pid, ...).

# running_pid PIDFILE: print the pid and succeed if that process is the daemon the file is named
# for. A machine stopped or restored with the cluster up leaves pid files whose numbers may since
# belong to other processes, which must be neither counted as the cluster nor killed.
running_pid() {
    [ -s "$1" ] || return 1
    local pid name
    pid=$(cat "$1")
    name=$(basename "$1" .pid)
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${name%%-*}" ] || return 1
    echo "$pid"
}
