#!/usr/bin/env bash
# A Slurm cluster on this machine, to try sbatch and for the tests: one node, or several.
#
#   launch/slurm/local-cluster.sh start [--nodes N]  # installs (apt, as root) and starts
#                                                    # munge, slurmctld and the slurmds;
#                                                    # waits for the nodes
#   launch/slurm/local-cluster.sh stop               # cancels the jobs, stops the daemons
#   launch/slurm/local-cluster.sh status             # prints each node's state; exits 1
#                                                    # if one is not up
#
# One node (the default) is this machine under its own name. With --nodes N (2 or more)
# the nodes are n1 .. nN, one slurmd each (`slurmd -N nI`, port 7817+I), all on this
# machine: a job sees N nodes (SLURM_JOB_NODELIST=n[1-2], SLURMD_NODENAME in each task)
# that share one kernel and its cores. All three are idempotent: `start` on a running
# cluster of that size only checks it (another size rewrites the configuration and
# restarts the daemons), `stop` on a stopped one does nothing. Each node offers CPUS
# (default 8) CPUs whatever the machine has (SlurmdParameters=config_overrides), so a job
# may start more ranks than cores. Needs root and Debian's packages (slurmctld, slurmd,
# slurm-client, munge), installed by `start` when missing. No systemd: the daemons are
# started by hand.
set -euo pipefail

CPUS=${CPUS:-8}
CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)

say() { echo "local-cluster: $*" >&2; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The nodes of the installed configuration, one a line.
configured_nodes() { sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF" 2>/dev/null || true; }

several() { [ "$(configured_nodes | wc -l)" -gt 1 ]; }

# A node's slurmd pidfile: one node keeps Debian's path, several have one each (%n).
pidfile_of() {
    if several; then echo "/run/slurmd-$1.pid"; else echo /run/slurmd.pid; fi
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v sbatch >/dev/null \
            && command -v munged >/dev/null; then
        return
    fi
    say "installing slurmctld slurmd slurm-client munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

# The slurmd and node lines: one node as before, or nodes n1 .. nN with paths per node.
node_lines() {
    local nodes=$1 i
    if [ "$nodes" -eq 1 ]; then
        echo "SlurmdSpoolDir=/var/spool/slurmd"
        echo "SlurmdPidFile=/run/slurmd.pid"
        echo "SlurmdLogFile=/var/log/slurm/slurmd.log"
        echo "NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=4096 State=UNKNOWN"
        return
    fi
    echo "SlurmdSpoolDir=/var/spool/slurmd-%n"
    echo "SlurmdPidFile=/run/slurmd-%n.pid"
    echo "SlurmdLogFile=/var/log/slurm/slurmd-%n.log"
    for i in $(seq 1 "$nodes"); do
        echo "NodeName=n$i NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=$((7817 + i))" \
             "CPUs=${CPUS} RealMemory=4096 State=UNKNOWN"
    done
}

write_config() {
    local nodes=$1 tmp
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
# written by launch/slurm/local-cluster.sh
ClusterName=local
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
MinJobAge=5
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
SlurmdParameters=config_overrides
$(node_lines "$nodes")
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm
    if ! cmp -s "$tmp" "$CONF"; then
        install -m 644 "$tmp" "$CONF"
        rm -f "$tmp"
        return 0          # changed: running daemons must restart
    fi
    rm -f "$tmp"
    return 1
}

node_state() { sinfo -h -n "$1" -o %T 2>/dev/null | head -1 || true; }

wait_idle() {
    local node state=""
    for node in $(configured_nodes); do
        for _ in $(seq 1 100); do
            state=$(node_state "$node")
            case "$state" in
                idle|mixed|allocated) continue 2 ;;
            esac
            sleep 0.2
        done
        say "node $node did not come up (state '${state}'); see /var/log/slurm/*.log"
        return 1
    done
}

start_daemons() {
    local node
    install -d -o munge -g munge -m 755 /run/munge
    if ! alive /run/munge/munged.pid; then
        runuser -u munge -- /usr/sbin/munged
    fi
    munge -n | unmunge >/dev/null || { say "munge does not work"; return 1; }
    alive /run/slurmctld.pid || slurmctld
    for node in $(configured_nodes); do
        if several; then
            mkdir -p "/var/spool/slurmd-$node"
            alive "$(pidfile_of "$node")" || slurmd -N "$node"
        else
            mkdir -p /var/spool/slurmd
            alive /run/slurmd.pid || slurmd
        fi
    done
    sleep 0.5
    alive /run/slurmctld.pid || { say "slurmctld died: /var/log/slurm/slurmctld.log"; return 1; }
    for node in $(configured_nodes); do
        alive "$(pidfile_of "$node")" \
            || { say "the slurmd of $node died: /var/log/slurm/slurmd*.log"; return 1; }
        scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
    done
    wait_idle
}

stop_daemons() {
    local pidfile pid
    if alive /run/slurmctld.pid; then
        scancel --state=RUNNING --full --quiet --user=root 2>/dev/null || true
        scancel --quiet --user=root 2>/dev/null || true
    fi
    # every slurmd there is, whichever configuration started it; then slurmctld, munged
    for pidfile in /run/slurmd.pid /run/slurmd-*.pid /run/slurmctld.pid \
                   /run/munge/munged.pid; do
        alive "$pidfile" || continue
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    # steps that outlived scancel and their daemons (ranks stuck in MPI_Init after Slurm's
    # PMI server refused one of them): ended with every process under them
    for pid in $(pgrep -x slurmstepd); do
        kill_tree "$pid"
    done
}

kill_tree() {
    local child
    kill -STOP "$1" 2>/dev/null || true
    for child in $(pgrep -P "$1"); do
        kill_tree "$child"
    done
    kill -KILL "$1" 2>/dev/null || true
}

case "${1:-}" in
    start)
        [ "$(id -u)" = 0 ] || { say "needs root (apt, daemons)"; exit 2; }
        nodes=1
        case "${2:-}" in
            "") ;;
            --nodes) nodes=${3:-} ;;
            --nodes=*) nodes=${2#--nodes=} ;;
            *) say "usage: $0 start [--nodes N]"; exit 2 ;;
        esac
        if ! [[ "$nodes" =~ ^[1-9][0-9]*$ ]]; then
            say "--nodes wants a count >= 1, got '$nodes'"
            exit 2
        fi
        install_packages
        if write_config "$nodes"; then
            stop_daemons        # a new configuration: restart with it
        fi
        start_daemons
        say "up: $(configured_nodes | paste -sd' ') with $CPUS CPUs each (sinfo, sbatch, squeue)"
        ;;
    stop)
        stop_daemons
        say "stopped"
        ;;
    status)
        up=0
        alive /run/slurmctld.pid || up=1
        for node in $(configured_nodes); do
            state=$(node_state "$node")
            echo "$node ${state:-down}"
            if [ -z "$state" ] || ! alive "$(pidfile_of "$node")"; then up=1; fi
        done
        exit "$up"
        ;;
    *)
        echo "usage: $0 start [--nodes N] | stop | status" >&2
        exit 2
        ;;
esac
