#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests: its own munged (own key, socket, pid,
# log and seed files), slurmctld and slurmd, all under one private folder DIR, with ports
# nothing else listens on. The system's munged and Slurm (if any) are left alone.
#
#   scripts/slurm-local.sh check          can one start here? one line, exit 0 or 1
#   scripts/slurm-local.sh up DIR         starts it (DIR must not exist); waits until the node is idle
#   scripts/slurm-local.sh env DIR        prints "export SLURM_CONF=DIR/slurm.conf" for the clients
#   scripts/slurm-local.sh status DIR     the daemons' pids and sinfo's view
#   scripts/slurm-local.sh down DIR       stops what up started (by its pid files), removes DIR
#
# Needs root (slurmd starts jobs as their user) and Debian's slurmctld, slurmd, slurm-client
# and munge (scripts/install-deps.sh). An up stopped by an error, ^C or SIGTERM removes what
# it made; down is idempotent.
set -euo pipefail
PROG=$(basename "$0")
die() { echo "$PROG: $*" >&2; exit 1; }
usage() { echo "$PROG: usage: $PROG check | up DIR | env DIR | status DIR | down DIR" >&2; exit 2; }

check() {
  [ "$(id -u)" -eq 0 ] || { echo "needs root (slurmd runs jobs as their user)"; return 1; }
  local c
  for c in munged slurmctld slurmd sbatch srun sinfo scontrol; do
    command -v "$c" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin command -v "$c" >/dev/null 2>&1 ||
      { echo "no $c (scripts/install-deps.sh installs slurmctld, slurmd, slurm-client and munge)"; return 1; }
  done
  echo "slurm $(PATH=$PATH:/usr/sbin slurmd -V 2>/dev/null | awk '{print $2}'), munge $(PATH=$PATH:/usr/sbin munged --version 2>/dev/null | awk '{print $1}' | sed 's/munge-//')"
}

# a TCP port no socket of the machine uses (the kernel's ephemeral range is avoided)
free_port() {
  local used p i
  used=$(ss -Htan 2>/dev/null | awk '{n = split($4, a, ":"); print a[n]}' | sort -u)
  for ((i = 0; i < 200; i++)); do
    p=$((20000 + RANDOM % 10000))
    grep -qx "$p" <<<"$used" || [ "$p" = "${1:-}" ] || { echo "$p"; return 0; }
  done
  return 1
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop DIR NAME: TERM the daemon of DIR/NAME.pid, KILL after 5 s
stop() {
  local pidf=$1/$2.pid pid i
  alive "$pidf" || return 0
  pid=$(cat "$pidf")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

down() {
  local dir=$1
  [ -d "$dir" ] || return 0
  [ -f "$dir/.slurm-local" ] || die "$dir was not made by $PROG up; not removing it"
  # jobs first (while the controller runs), then the daemons; slurmd's steps end with it
  if alive "$dir/slurmctld.pid"; then SLURM_CONF=$dir/slurm.conf timeout 5 scancel --full --quiet --user=root 2>/dev/null || true; fi
  stop "$dir" slurmd
  # slurmstepd processes left by a killed slurmd: those whose spool is ours
  local p
  for p in $(pgrep -x slurmstepd 2>/dev/null || true); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q "$dir" && kill -KILL "$p" 2>/dev/null || true
  done
  stop "$dir" slurmctld
  stop "$dir" munged
  rm -rf "$dir"
}

up() {
  local dir=$1 host cpus ctld_port d_port i
  [ ! -e "$dir" ] || die "$dir exists (down it first, or choose another folder)"
  local why; why=$(check) || die "$why"
  export PATH=$PATH:/usr/sbin
  mkdir -m 700 "$dir"
  touch "$dir/.slurm-local"
  dir=$(cd "$dir" && pwd)
  trap 'down "$dir"' EXIT
  trap 'exit 130' INT; trap 'exit 143' TERM
  mkdir -m 700 "$dir/state" "$dir/spool"

  # munge: a fresh key; the daemon's files all inside DIR
  dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
  chmod 600 "$dir/munge.key"
  munged --socket="$dir/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" --num-threads=2 --force 2>"$dir/munged.err" ||
    die "munged did not start: $(tail -1 "$dir/munged.err" "$dir/munged.log" 2>/dev/null | grep -v '^==>' | grep . | tail -1)"
  for ((i = 0; i < 50; i++)); do [ -S "$dir/munge.socket" ] && alive "$dir/munged.pid" && break; sleep 0.1; done
  [ -S "$dir/munge.socket" ] || die "munged made no socket in 5 s: $(tail -1 "$dir/munged.log" 2>/dev/null)"

  host=$(hostname -s)
  cpus=$(nproc)
  ctld_port=$(free_port) || die "no free TCP port"
  d_port=$(free_port "$ctld_port") || die "no free TCP port"
  local mpi=none
  if ls /usr/lib/*/slurm*/mpi_pmix.so >/dev/null 2>&1; then mpi=pmix; fi
  cat >"$dir/slurm.conf" <<EOF
# made by $PROG up: one node, this machine; everything in $dir
ClusterName=meshtrain-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=$mpi
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF=$dir/slurm.conf
  # in the foreground (-D) under setsid, so the pid is ours at once and no terminal reaches them
  setsid slurmctld -D -c -i -f "$dir/slurm.conf" </dev/null >"$dir/slurmctld.out" 2>&1 &
  echo $! >"$dir/slurmctld.pid"
  setsid slurmd -D -f "$dir/slurm.conf" -N "$host" </dev/null >"$dir/slurmd.out" 2>&1 &
  echo $! >"$dir/slurmd.pid"
  local state=""
  for ((i = 0; i < 150; i++)); do
    alive "$dir/slurmctld.pid" || die "slurmctld ended: $(tail -1 "$dir/slurmctld.log" "$dir/slurmctld.out" 2>/dev/null | grep -v '^==>' | grep . | tail -1)"
    alive "$dir/slurmd.pid" || die "slurmd ended: $(tail -1 "$dir/slurmd.log" "$dir/slurmd.out" 2>/dev/null | grep -v '^==>' | grep . | tail -1)"
    state=$(timeout 5 sinfo -h -N -n "$host" -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.2
  done
  [ "$state" = idle ] || die "node $host not idle after 30 s (state '${state:-none}'): $(tail -1 "$dir/slurmd.log" 2>/dev/null)"
  trap - EXIT INT TERM
  echo "slurm up in $dir: node $host ($cpus CPUs) idle, ports $ctld_port/$d_port, MpiDefault=$mpi; export SLURM_CONF=$dir/slurm.conf"
}

status() {
  local dir=$1 n
  [ -f "$dir/.slurm-local" ] || die "no cluster of $PROG in $dir"
  for n in munged slurmctld slurmd; do
    if alive "$dir/$n.pid"; then echo "$n $(cat "$dir/$n.pid")"; else echo "$n not running"; fi
  done
  SLURM_CONF=$dir/slurm.conf timeout 5 sinfo -N 2>&1 || true
}

case "${1:-}" in
  check) [ $# -eq 1 ] || usage; check ;;
  up) [ $# -eq 2 ] || usage; up "$2" ;;
  down) [ $# -eq 2 ] || usage; down "$2" ;;
  status) [ $# -eq 2 ] || usage; status "$2" ;;
  env) [ $# -eq 2 ] || usage; [ -f "$2/slurm.conf" ] || die "no cluster of $PROG in $2"; echo "export SLURM_CONF=$(cd "$2" && pwd)/slurm.conf" ;;
  *) usage ;;
esac
