#!/usr/bin/env bash
# Stop the cluster tests/slurm/start_cluster.sh DIR started: cancel its jobs, then stop slurmd,
# slurmctld and munged by the pids it recorded, and any job step daemon (slurmstepd) of this
# cluster still running (found by its open files under DIR). Leaves DIR itself to its owner.
set -uo pipefail
DIR="${1:?usage: stop_cluster.sh DIR}"
DIR="$(cd "$DIR" 2>/dev/null && pwd)" || exit 0
[ -f "$DIR/pids" ] || exit 0

alive() { kill -0 "$1" 2>/dev/null; }
pid_of() { awk -v n="$1" '$1 == n {print $2}' "$DIR/pids"; }

# step daemons of this cluster: slurmstepd processes holding a file under DIR
stepds() {
    local p
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
        if ls -l "$p/fd" "$p/cwd" 2>/dev/null | grep -q -- "-> $DIR/"; then echo "${p#/proc/}"; fi
    done
}

if [ -f "$DIR/slurm.conf" ] && alive "$(pid_of slurmctld)"; then
    SLURM_CONF="$DIR/slurm.conf" timeout 10 scancel --full --quiet --user=root 2>/dev/null
    for _ in $(seq 1 50); do
        [ -z "$(SLURM_CONF="$DIR/slurm.conf" timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.2
    done
fi
for name in slurmd slurmctld munged; do
    pid="$(pid_of "$name")"
    [ -n "$pid" ] && alive "$pid" && kill -TERM "$pid"
    for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -KILL "$pid"
done
for pid in $(stepds); do kill -KILL "$pid" 2>/dev/null; done
exit 0
