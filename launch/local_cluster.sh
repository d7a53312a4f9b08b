#!/usr/bin/env bash
# A real two-node Slurm cluster on one machine, for the tests and for trying the templates.
#
#   sudo bash launch/local_cluster.sh [start]   # install (apt) if needed, configure, start, wait
#   sudo bash launch/local_cluster.sh status    # sinfo, exit 0 only if both nodes are usable
#   sudo bash launch/local_cluster.sh stop      # stop the daemons this script started
#
# Debian's slurmctld, slurmd, slurm-client and munge. The two "nodes" node1 and node2 are two
# `slurmd -N nodeN` daemons on this machine, both NodeAddr=127.0.0.1 with their own Port. Debian's
# slurmd accepts -N (see `slurmd -h`); spool dir, pid file and log use %n so the two never share a
# file. Each node advertises all of this machine's CPUs: the cluster overcommits, which is fine for
# gloo tests. No cgroups (containers rarely delegate them): proctrack/linuxproc, task/none.
#
# Everything lives under DDPTRAIN_SLURM_DIR (default /tmp/ddptrain-slurm): etc/slurm.conf, state,
# spool, logs, pid files. /etc/slurm/slurm.conf becomes a symlink to our file unless a real one
# already exists there; otherwise `export SLURM_CONF=$DDPTRAIN_SLURM_DIR/etc/slurm.conf`.
# Idempotent: a second `start` with the cluster up returns in well under a second. A controller
# that answers on our port but is not ours (another cluster on this machine, or this script with
# another DDPTRAIN_SLURM_DIR) is refused: jobs would silently go to it. Pick other ports then.
#
# Knobs (environment): DDPTRAIN_SLURM_DIR, DDPTRAIN_SLURM_CTLD_PORT (6817),
# DDPTRAIN_SLURM_NODE_PORTS ("6818 6819"), DDPTRAIN_SLURM_CPUS (nproc).
set -euo pipefail

readonly SLURM_DIR="${DDPTRAIN_SLURM_DIR:-/tmp/ddptrain-slurm}"
readonly CONF="$SLURM_DIR/etc/slurm.conf"
readonly CTLD_PORT="${DDPTRAIN_SLURM_CTLD_PORT:-6817}"
read -r -a NODE_PORTS <<<"${DDPTRAIN_SLURM_NODE_PORTS:-6818 6819}"
readonly NODES=(node1 node2)
readonly PARTITION=debug
readonly CLUSTER=ddptrain
export SLURM_CONF="$CONF"

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

pid_alive() { # pid file -> 0 if the process it names is running
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    ((${#missing[@]} == 0)) && return 0
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0 # already running (ours, or the distribution's service)
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    # munged refuses to run as root with a munge-owned key; run it as its own user.
    # --force: a stale socket left by a killed munged would otherwise stop it.
    runuser -u munge -- munged --force --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not start (see /var/log/munge/munged.log)"
}

write_conf() { # writes $CONF.new; the caller decides whether it changed
    local cpus="${DDPTRAIN_SLURM_CPUS:-$(nproc)}" host
    host="$(hostname -s 2>/dev/null || hostname)"
    mkdir -p "$SLURM_DIR"/{etc,state,log,run,spool}
    cat >"$CONF.new" <<EOF
# Written by launch/local_cluster.sh: a two-node Slurm cluster on one machine ($host).
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (slurm.conf(5), AuthInfo);
# the default 120 s would make every preemption test wait two minutes.
AuthInfo=cred_expire=10
StateSaveLocation=$SLURM_DIR/state
SlurmctldPidFile=$SLURM_DIR/run/slurmctld.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
# %n = the node name given to slurmd -N: one spool dir, pid file and log per node.
SlurmdSpoolDir=$SLURM_DIR/spool/%n
SlurmdPidFile=$SLURM_DIR/run/slurmd-%n.pid
SlurmdLogFile=$SLURM_DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: track job processes by parent pid, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# Look at pending (e.g. requeued) jobs every second or two, not every 30/60 s.
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Preemption the way the templates use it: scontrol requeue of a running batch job.
JobRequeue=1
# A node that lost contact (daemons restarted) comes back by itself.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=30
Waittime=0
EOF
    local i
    for i in "${!NODES[@]}"; do
        echo "NodeName=${NODES[$i]} NodeAddr=127.0.0.1 NodeHostname=$host Port=${NODE_PORTS[$i]} CPUs=$cpus State=UNKNOWN" >>"$CONF.new"
    done
    echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$CONF.new"
}

add_hosts() { # node names resolve to loopback, like a real cluster's DNS
    local node
    for node in "${NODES[@]}"; do
        if ! grep -Eq "^[^#]*[[:space:]]$node([[:space:]]|\$)" /etc/hosts; then
            # /etc/hosts may be a bind mount (containers): append in place, never replace it.
            echo "127.0.0.1 $node" >>/etc/hosts
        fi
    done
}

link_default_conf() {
    mkdir -p /etc/slurm
    if [[ -L /etc/slurm/slurm.conf || ! -e /etc/slurm/slurm.conf ]]; then
        ln -sfn "$CONF" /etc/slurm/slurm.conf
    else
        log "/etc/slurm/slurm.conf exists and is not ours: export SLURM_CONF=$CONF"
    fi
}

start_daemons() {
    if ! pid_alive "$SLURM_DIR/run/slurmctld.pid"; then
        slurmctld -f "$CONF"
    fi
    local node
    for node in "${NODES[@]}"; do
        mkdir -p "$SLURM_DIR/spool/$node"
        if ! pid_alive "$SLURM_DIR/run/slurmd-$node.pid"; then
            slurmd -f "$CONF" -N "$node"
        fi
    done
}

nodes_idle() { # true when every node is idle (or running jobs: mixed/allocated)
    local states
    states="$(sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null)" || return 1
    local node
    for node in "${NODES[@]}"; do
        grep -Eq "^$node (idle|mix|alloc|comp)\$" <<<"$states" || return 1
    done
}

wait_idle() {
    local deadline=$((SECONDS + ${DDPTRAIN_SLURM_WAIT:-60})) resumed=0
    until nodes_idle; do
        if ((SECONDS > deadline)); then
            sinfo -N -l >&2 || true
            die "nodes not idle after ${DDPTRAIN_SLURM_WAIT:-60}s; logs in $SLURM_DIR/log"
        fi
        # A node marked down by an earlier run (killed daemons) needs one explicit resume.
        if ((!resumed)) && sinfo -h -N -o '%t' 2>/dev/null | grep -Eq '^(down|drain)'; then
            scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME 2>/dev/null || true
            resumed=1
        fi
        sleep 0.5
    done
}

# The controller answering on our port: "ClusterName SLURM_CONF" as it reports them itself;
# nothing when none answers.
answering_controller() {
    local shown
    shown="$(scontrol show config 2>/dev/null)" || return 0
    awk -F' += +' '
        $1 == "ClusterName" { name = $2 }
        $1 == "SLURM_CONF" { conf = $2 }
        END { if (name != "") print name, conf }' <<<"$shown"
}

# Refuse to go on when a controller that is not ours answers on our port.
refuse_foreign_controller() {
    local answering
    answering="$(answering_controller)"
    [[ -z "$answering" || "$answering" == "$CLUSTER $CONF" ]] && return 0
    die "a Slurm controller that is not this cluster's answers on port $CTLD_PORT" \
        "(cluster ${answering% *}, config ${answering#* }; ours: cluster $CLUSTER, config $CONF)." \
        "Stop it, or use other ports: DDPTRAIN_SLURM_CTLD_PORT and DDPTRAIN_SLURM_NODE_PORTS"
}

all_running() {
    pid_alive "$SLURM_DIR/run/slurmctld.pid" || return 1
    local node
    for node in "${NODES[@]}"; do
        pid_alive "$SLURM_DIR/run/slurmd-$node.pid" || return 1
    done
}

cmd_start() {
    [[ "$(id -u)" == 0 ]] || die "run as root (installs packages, starts daemons, edits /etc/hosts)"
    # Fast path: configured, running and idle -> nothing to do.
    if [[ -s "$CONF" ]] && all_running && command -v sinfo >/dev/null && nodes_idle; then
        write_conf
        if cmp -s "$CONF" "$CONF.new"; then
            rm -f "$CONF.new"
            refuse_foreign_controller
            log "already running ($CONF)"
            return 0
        fi
    fi
    install_packages
    start_munge
    write_conf
    if ! cmp -s "$CONF" "$CONF.new" 2>/dev/null; then
        [[ -e "$CONF" ]] && cmd_stop
        mv "$CONF.new" "$CONF"
    else
        rm -f "$CONF.new"
    fi
    # Before touching /etc: our slurmctld could not take the port, and jobs would go to the other.
    refuse_foreign_controller
    add_hosts
    link_default_conf
    start_daemons
    wait_idle
    refuse_foreign_controller
    log "up: $(sinfo -h -N -o '%N=%t' | tr '\n' ' ')(SLURM_CONF=$CONF)"
}

stop_pidfile() { # stop the daemon named by a pid file, wait for it to go
    local file="$1" pid
    pid_alive "$file" || { rm -f "$file"; return 0; }
    pid="$(cat "$file")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    rm -f "$file"
}

cmd_stop() {
    local node
    for node in "${NODES[@]}"; do
        stop_pidfile "$SLURM_DIR/run/slurmd-$node.pid"
    done
    stop_pidfile "$SLURM_DIR/run/slurmctld.pid"
    # munged stays: it may be the system's, and it costs nothing.
    log "stopped"
}

cmd_status() {
    sinfo -N -l
    all_running && nodes_idle && refuse_foreign_controller
}

case "${1:-start}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) die "usage: $0 [start|stop|status]" ;;
esac
