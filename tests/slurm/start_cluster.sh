#!/usr/bin/env bash
# A one-machine SLURM cluster for tests/launch/test_slurm.py: Debian's slurm-wlm (slurmctld, slurmd) and munge,
# started directly (no systemd), everything they write under one directory.
#
#   bash tests/slurm/start_cluster.sh          install the packages if missing (what .ci/run does before
#                                              `make test`, so that the test itself only starts daemons)
#   bash tests/slurm/start_cluster.sh DIR      install if missing, then start munged, slurmctld and slurmd
#                                              with their config, keys, state, logs and sockets in DIR, and
#                                              wait until the node takes jobs; DIR/env then holds the
#                                              variables a client needs (SLURM_CONF), DIR/pids the daemons'
#   bash tests/slurm/stop_cluster.sh DIR       stop what the second form started
#
# Exit status: 0 ready; 3 the packages are missing and cannot be installed; 4 a daemon did not start.
# The last line on stderr says why (the test skips with it).
set -uo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
DIR="${1:-}"

fail() { echo "start_cluster.sh: $2" >&2; [ -n "$DIR" ] && [ -d "$DIR" ] && echo "$2" > "$DIR/reason"; exit "$1"; }

missing_packages() {
    local p out=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || out+=("$p")
    done
    echo "${out[@]:-}"
}

install_packages() {
    local missing
    missing="$(missing_packages)"
    [ -z "$missing" ] && return 0
    command -v apt-get >/dev/null || fail 3 "SLURM packages not installed ($missing) and there is no apt-get here"
    [ "$(id -u)" = 0 ] || fail 3 "SLURM packages not installed ($missing); installing them needs root: apt-get install $missing"
    local log; log="$(mktemp /tmp/torchbay-slurm-apt.XXXXXX)"
    export DEBIAN_FRONTEND=noninteractive
    # the package lists may be absent or stale (a fresh image): update only when the first try fails
    if ! timeout 150 apt-get install -y -q --no-install-recommends $missing >"$log" 2>&1; then
        timeout 90 apt-get update -q >>"$log" 2>&1
        if ! timeout 150 apt-get install -y -q --no-install-recommends $missing >>"$log" 2>&1; then
            local why; why="$(grep -E '^(E:|W:)' "$log" | tail -1)"
            rm -f "$log"
            fail 3 "apt-get install $missing failed: ${why:-see apt-get output}"
        fi
    fi
    rm -f "$log"
    missing="$(missing_packages)"
    [ -z "$missing" ] || fail 3 "apt-get install finished but $missing is still not installed"
}

install_packages
[ -z "$DIR" ] && { echo "start_cluster.sh: SLURM packages installed (${PACKAGES[*]})"; exit 0; }

[ "$(id -u)" = 0 ] || fail 4 "starting slurmd needs root (it starts job steps as their user); run the tests as root"
for tool in munged slurmctld slurmd sinfo srun sbatch python3; do
    command -v "$tool" >/dev/null || fail 3 "$tool not found on PATH after installing ${PACKAGES[*]}"
done
mkdir -p "$DIR" || fail 4 "cannot create $DIR"
DIR="$(cd "$DIR" && pwd)"
chmod 700 "$DIR"
mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool" "$DIR/log"
chmod 700 "$DIR/munge"
: > "$DIR/pids"

# two free TCP ports (controller, node daemon), so that clusters of concurrent test runs never meet
read -r CTLD_PORT SLURMD_PORT < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
EOF
)
[ -n "${SLURMD_PORT:-}" ] || fail 4 "could not find two free TCP ports"
HOST="$(hostname -s)"
# a job's ranks meet at the first node's name (torchbay's MASTER_ADDR), as on a real cluster
getent hosts "$HOST" >/dev/null || fail 4 "this machine's name '$HOST' does not resolve (getent hosts $HOST); ranks meet at the node's name: add it to /etc/hosts"
CPUS="$(nproc)"; [ "$CPUS" -lt 2 ] && CPUS=2
# job ids start at a random number: torchbay derives a job's default port from the id's last 4 digits
FIRST_JOB_ID=$(( (RANDOM % 9000) * 10 + 1000 ))

dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/munge/munge.key"
MUNGE_SOCKET="$DIR/munge/munge.socket"
munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
    >"$DIR/log/munged.out" 2>&1 || fail 4 "munged did not start: $(tail -1 "$DIR/log/munged.out")"
echo "munged $(cat "$DIR/munge/munged.pid")" >> "$DIR/pids"

cat > "$DIR/slurm.conf" <<EOF
# written by tests/slurm/start_cluster.sh: one node, this machine; all state under $DIR
ClusterName=torchbaytest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId=$FIRST_JOB_ID
KillWait=5
MessageTimeout=20
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$DIR/slurm.conf"
echo "SLURM_CONF=$SLURM_CONF" > "$DIR/env"

slurmctld -D -i -f "$SLURM_CONF" >"$DIR/log/slurmctld.out" 2>&1 &
echo "slurmctld $!" >> "$DIR/pids"
slurmd -D -f "$SLURM_CONF" -N "$HOST" >"$DIR/log/slurmd.out" 2>&1 &
echo "slurmd $!" >> "$DIR/pids"

# ready when the node is idle (slurmd registered with slurmctld)
for _ in $(seq 1 150); do
    while read -r name pid; do
        kill -0 "$pid" 2>/dev/null || fail 4 "$name exited at start: $(tail -1 "$DIR/log/$name.log" "$DIR/log/$name.out" 2>/dev/null | grep -v '^==>' | grep . | tail -1)"
    done < "$DIR/pids"
    state="$(sinfo -h -N -o %T 2>/dev/null | head -1)"
    case "$state" in
        idle*) echo "start_cluster.sh: SLURM ready in $DIR (node $HOST, $CPUS CPUs, slurmctld :$CTLD_PORT, slurmd :$SLURMD_PORT)"; exit 0 ;;
    esac
    sleep 0.2
done
fail 4 "the node did not become idle within 30 s (state '${state:-none}'); see $DIR/log/slurmctld.log and slurmd.log"
