#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, to try sbatch and for the tests.
#
#   launch/slurm/local-cluster.sh start    # installs (apt, as root) and starts munge,
#                                          # slurmctld and slurmd; waits for the node
#   launch/slurm/local-cluster.sh stop     # cancels the jobs and stops the daemons
#   launch/slurm/local-cluster.sh status   # prints the node's state; exits 1 if not up
#
# Both are idempotent: `start` on a running cluster only checks it, `stop` on a stopped
# one does nothing. The node offers CPUS (default 8) CPUs whatever the machine has
# (SlurmdParameters=config_overrides), so a job may start more ranks than cores. Needs
# root and Debian's packages (slurmctld, slurmd, slurm-client, munge), installed by
# `start` when missing. No systemd: the daemons are started by hand.
set -euo pipefail

CPUS=${CPUS:-8}
CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)
PIDS=(/run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid)

say() { echo "local-cluster: $*" >&2; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

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

write_config() {
    local tmp
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
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
SlurmdParameters=config_overrides
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=4096 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    if ! cmp -s "$tmp" "$CONF"; then
        install -m 644 "$tmp" "$CONF"
        rm -f "$tmp"
        return 0          # changed: running daemons must restart
    fi
    rm -f "$tmp"
    return 1
}

wait_idle() {
    local state=""
    for _ in $(seq 1 100); do
        state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1 || true)
        case "$state" in
            idle|mixed|allocated) return 0 ;;
        esac
        sleep 0.2
    done
    say "the node did not come up (state '${state}'); see /var/log/slurm/*.log"
    return 1
}

start_daemons() {
    install -d -o munge -g munge -m 755 /run/munge
    if ! alive /run/munge/munged.pid; then
        runuser -u munge -- /usr/sbin/munged
    fi
    munge -n | unmunge >/dev/null || { say "munge does not work"; return 1; }
    alive /run/slurmctld.pid || slurmctld
    alive /run/slurmd.pid || slurmd
    sleep 0.5
    alive /run/slurmctld.pid || { say "slurmctld died: /var/log/slurm/slurmctld.log"; return 1; }
    alive /run/slurmd.pid || { say "slurmd died: /var/log/slurm/slurmd.log"; return 1; }
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    wait_idle
}

stop_daemons() {
    if alive /run/slurmctld.pid; then
        scancel --state=RUNNING --full --quiet --user=root 2>/dev/null || true
        scancel --quiet --user=root 2>/dev/null || true
    fi
    for pidfile in "${PIDS[@]}"; do
        alive "$pidfile" || continue
        local pid
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    start)
        [ "$(id -u)" = 0 ] || { say "needs root (apt, daemons)"; exit 2; }
        install_packages
        if write_config; then
            stop_daemons        # a new configuration: restart with it
        fi
        start_daemons
        say "up: node $HOST with $CPUS CPUs (sinfo, sbatch, squeue)"
        ;;
    stop)
        stop_daemons
        say "stopped"
        ;;
    status)
        state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1 || true)
        echo "${state:-down}"
        [ -n "$state" ] && alive /run/slurmctld.pid && alive /run/slurmd.pid
        ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 2
        ;;
esac
