#!/usr/bin/env bash
# An emulated cluster on one machine: N hosts as network namespaces, each joined by a veth
# pair to a bridge in a "switch" namespace, every link shaped with tc; ranks started by
# mpirun in the namespaces, so Open MPI sees separate hosts (TCP between them, shared memory
# inside one). Nothing is made in the machine's own namespace: the clusters' addresses exist
# only inside them. docs/cluster.md says how to use it and what it cannot emulate.
#
#   cluster.sh check                              can clusters be made here? (one line)
#   cluster.sh up NAME [--hosts N] [--rate R] [--delay D] [--no-measure]
#   cluster.sh down NAME                          removes everything NAME made (idempotent)
#   cluster.sh list                               the clusters that exist, one a line
#   cluster.sh info NAME                          hosts, addresses, link, measured bandwidth
#   cluster.sh measure NAME [--from I] [--to J] [--seconds S]
#   cluster.sh exec NAME I -- CMD...              runs CMD on host I
#   cluster.sh run NAME [--per-host K] -- MPIRUN_ARGS...   mpirun from host 0 over all hosts
#   cluster.sh mpirun-args NAME [--per-host K]    the options `run` gives mpirun
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
NETBENCH=$(dirname "$SELF")/netbench.py
NET=10.213          # clusters take 10.213.S.0/24, S the first subnet in use nowhere on the machine
LOCK=$SELF      # flock on the script itself: no lock file to leave behind

die()   { echo "cluster.sh: $*" >&2; exit 1; }
usage() { echo "cluster.sh: $*" >&2; exit 2; }

check_name() {
  # one word, so that the prefix mt-NAME- of one cluster never matches another's names
  [[ ${1:-} =~ ^[a-z0-9]{1,12}$ ]] || usage "cluster name '${1:-}': want 1-12 of a-z, 0-9"
}
sw()   { echo "mt-$1-sw"; }
host() { echo "mt-$1-h$2"; }
# namespaces of cluster $1 (or of every cluster, with no $1), one a line
namespaces() {
  local pat=${1:-[a-z0-9]+}
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^mt-$pat-(sw|h[0-9]+)$" || true
}
exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$(sw "$1")"; }
n_hosts() { namespaces "$1" | grep -c -- '-h[0-9]*$' || true; }
addr() { ip -n "$(host "$1" "$2")" -4 -o addr show dev eth0 | awk '{split($4, a, "/"); print a[1]}'; }
subnet() { local a; a=$(addr "$1" 0); echo "${a%.*}.0/24"; }
describe() { ip -n "$(sw "$1")" -o link show dev br0 | sed -n 's/.* alias //p'; }

# bits per second of a tc rate (kbit, mbit, gbit: powers of 1000, as tc reads them)
rate_bits() {
  local n=${1%%[a-z]*} u=${1##*[0-9.]}
  local m; case $u in bit) m=1 ;; kbit) m=1000 ;; mbit) m=1000000 ;; gbit) m=1000000000 ;; esac
  awk -v n="$n" -v m="$m" 'BEGIN {printf "%.0f", n * m}'
}

cmd_check() {
  local probe="mt-probe$$-sw" delay
  ip -V >/dev/null 2>&1 && tc -V >/dev/null 2>&1 || die "cannot make clusters: ip and tc (iproute2) are not installed"
  [ "$(id -u)" = 0 ] || die "cannot make clusters: network namespaces need root"
  ip netns add "$probe" 2>/dev/null || die "cannot make clusters: 'ip netns add' is not allowed here"
  trap "ip netns delete $probe 2>/dev/null || true" EXIT
  ip -n "$probe" link add p0 type veth peer name p1 2>/dev/null || die "cannot make clusters: no veth devices"
  tc -n "$probe" qdisc add dev p0 root handle 1: tbf rate 1gbit burst 128kb latency 20ms 2>/dev/null ||
    die "cannot make clusters: no tbf qdisc to shape a link"
  if tc -n "$probe" qdisc add dev p0 parent 1:1 handle 10: netem delay 1ms 2>/dev/null; then delay=yes
  else delay="no (this kernel has no netem qdisc)"; fi
  command -v python3 >/dev/null || delay="$delay; measure: no (needs python3)"
  echo "cluster.sh: clusters can be made here; rate: yes; delay: $delay"
}

# The first subnet 10.213.S.0/24 that no address or route of the machine and no other
# namespace uses. Called under the lock, so two clusters coming up together differ.
free_subnet() {
  local used s ns
  used=$( { ip -4 -o addr; ip -4 route; for ns in $(ip netns list | awk '{print $1}'); do
            ip -n "$ns" -4 -o addr 2>/dev/null || true; done; } | grep -o "$NET\.[0-9]*\." | sort -u || true)
  ! ip -4 route | grep -q "^$NET\.0\.0/16 " || die "$NET.0.0/16 is routed on this machine; no subnet is free"
  for s in $(seq 1 254); do
    grep -qx "$NET\.$s\." <<<"$used" || { echo "$NET.$s"; return; }
  done
  die "no free subnet in $NET.0.0/16"
}

# tbf at the link's rate on one end of a link (its egress); netem below it for the delay.
# The bucket holds 1 ms at the rate (at least 64 KiB, one segment of veth's offload), so
# a timer that wakes late does not cut the rate; the queue holds up to 20 ms.
shape() {
  local ns=$1 dev=$2 rate=$3 delay=$4 burst
  burst=$(( $(rate_bits "$rate") / 8000 )); [ "$burst" -lt 65536 ] && burst=65536
  tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst "$burst" latency 20ms
  if [ "$delay" != 0 ]; then
    tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: netem delay "$delay" limit 100000 2>/dev/null ||
      die "--delay needs the netem qdisc, which this kernel lacks; leave --delay out"
  fi
}

cmd_up() {
  local name=$1 hosts=2 rate=1gbit delay=0 measure=1; shift
  check_name "$name"
  while [ $# -gt 0 ]; do
    case $1 in
      --hosts) hosts=${2:-}; shift 2 || usage "--hosts needs a value" ;;
      --rate) rate=${2:-}; shift 2 || usage "--rate needs a value" ;;
      --delay) delay=${2:-}; shift 2 || usage "--delay needs a value" ;;
      --no-measure) measure=0; shift ;;
      *) usage "up: unknown option '$1'" ;;
    esac
  done
  [[ $hosts =~ ^[0-9]+$ ]] && [ "$hosts" -ge 1 ] && [ "$hosts" -le 64 ] || usage "--hosts '$hosts': want 1 to 64"
  [[ $rate =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] && [ "$(rate_bits "$rate")" -ge 8000 ] ||
    usage "--rate '$rate': want a number with bit, kbit, mbit or gbit (at least 8kbit), e.g. 100mbit"
  [[ $delay =~ ^(0|[0-9]+(\.[0-9]+)?(us|ms))$ ]] || usage "--delay '$delay': want a number with us or ms, e.g. 0.1ms"
  [[ $delay =~ ^0+(\.0+)?(us|ms)$ ]] && delay=0   # no delay: no netem needed
  [ "$(id -u)" = 0 ] || die "cannot make clusters: network namespaces need root"
  exists "$name" && die "cluster $name exists; 'cluster.sh down $name' first"

  # Whatever stops the setup (an error, ^C, a kill) removes what it made so far.
  trap "cmd_down $name" EXIT   # (a checked name: no quoting needed)
  trap 'exit 130' INT; trap 'exit 143' TERM
  exec 9<"$LOCK"; flock -w 30 9 || die "another cluster.sh up holds $LOCK"
  local net k ns; net=$(free_subnet)
  ip netns add "$(sw "$name")"
  ip -n "$(sw "$name")" link set lo up
  ip -n "$(sw "$name")" link add br0 type bridge
  ip -n "$(sw "$name")" link set br0 up
  for ((k = 0; k < hosts; k++)); do
    ns=$(host "$name" "$k")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # made inside the switch, its peer inside the host: no device ever sits in the root namespace
    ip -n "$(sw "$name")" link add "h$k" type veth peer name eth0 netns "$ns"
    ip -n "$(sw "$name")" link set "h$k" master br0 up
    ip -n "$ns" addr add "$net.$((k + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    # both directions of the link at the rate (a host receiving from many is held to it too);
    # the delay once, on the host's side, so host to host is one delay each way
    shape "$ns" eth0 "$rate" "$delay"
    shape "$(sw "$name")" "h$k" "$rate" 0
  done
  flock -u 9
  local desc="hosts=$hosts rate=$rate delay=$delay subnet=$net.0/24"
  ip -n "$(sw "$name")" link set br0 alias "$desc"
  if [ "$measure" = 1 ] && [ "$hosts" -ge 2 ]; then
    desc="$desc $(measure_link "$name" 0 1 1)"
    ip -n "$(sw "$name")" link set br0 alias "$desc"
  fi
  trap - EXIT INT TERM
  echo "cluster $name: $desc"
}

cmd_down() {
  local name=$1 ns pids i
  check_name "$name"
  # h0 first: a signal to mpirun there ends the job on every host in order; killing another
  # host's daemon first makes mpirun abort noisily
  for ns in $(namespaces "$name" | sort -V); do
    # a process left inside (a rank, a daemon) keeps the namespace alive after its name goes
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
      [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && break; sleep 0.1
    done
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    ip netns delete "$ns" 2>/dev/null || true
  done
  # what Open MPI leaves when its job is killed: session folders and shared memory, named by
  # the hosts' names (each host has its own, see cmd_exec)
  rm -rf /tmp/ompi."mt-$name-h"[0-9]*.* /dev/shm/vader_segment."mt-$name-h"[0-9]*.* 2>/dev/null || true
  [ -z "$(namespaces "$name")" ] || die "could not remove: $(namespaces "$name" | tr '\n' ' ')"
}

cmd_list() {
  local ns
  for ns in $(namespaces | grep -- '-sw$'); do
    ns=${ns#mt-}; echo "${ns%-sw}: $(describe "${ns%-sw}")"
  done
}

need_cluster() { check_name "${1:-}"; exists "$1" || die "no cluster named $1 ('cluster.sh up $1' makes it)"; }

cmd_info() {
  local name=$1 k; need_cluster "$name"
  echo "cluster $name: $(describe "$name")"
  for ((k = 0; k < $(n_hosts "$name"); k++)); do echo "  h$k $(host "$name" "$k") $(addr "$name" "$k")"; done
}

# measure_link NAME I J SECONDS: "measured=X.XMbit/s rtt=Y.YYms" from host I to host J
measure_link() {
  local name=$1 i=$2 j=$3 secs=$4 to out
  command -v python3 >/dev/null || die "measure needs python3"
  to=$(addr "$name" "$j")
  ip netns exec "$(host "$name" "$j")" timeout $((secs + 20)) python3 "$NETBENCH" serve "$to" "$secs" &
  local srv=$!
  out=$(ip netns exec "$(host "$name" "$i")" timeout $((secs + 20)) python3 "$NETBENCH" send "$to" "$secs") ||
    { kill "$srv" 2>/dev/null || true; wait "$srv" 2>/dev/null || true; die "measure: h$i to h$j failed"; }
  wait "$srv" || die "measure: the receiver on h$j failed"
  awk '{printf "measured=%.1fMbit/s rtt=%.3fms", $1 / 1e6, $2 * 1e3}' <<<"$out"
}

cmd_measure() {
  local name=$1 i=0 j=1 secs=2 n m; shift; need_cluster "$name"
  while [ $# -gt 0 ]; do
    case $1 in
      --from) i=${2:-}; shift 2 || usage "--from needs a value" ;;
      --to) j=${2:-}; shift 2 || usage "--to needs a value" ;;
      --seconds) secs=${2:-}; shift 2 || usage "--seconds needs a value" ;;
      *) usage "measure: unknown option '$1'" ;;
    esac
  done
  n=$(n_hosts "$name")
  [[ $i =~ ^[0-9]+$ && $j =~ ^[0-9]+$ ]] && [ "$i" -lt "$n" ] && [ "$j" -lt "$n" ] && [ "$i" != "$j" ] ||
    usage "measure: --from and --to want two different hosts of 0..$((n - 1))"
  [[ $secs =~ ^[0-9]+$ ]] && [ "$secs" -ge 1 ] && [ "$secs" -le 60 ] || usage "--seconds '$secs': want 1 to 60"
  m=$(measure_link "$name" "$i" "$j" "$secs")
  echo "cluster $name: $(describe "$name" | sed 's/ measured=.*//') h$i->h$j $m"
}

cmd_exec() {
  local name=$1 k=${2:-}; need_cluster "$name"
  [[ $k =~ ^[0-9]+$ ]] && [ "$k" -lt "$(n_hosts "$name")" ] || usage "exec: no host '$k' in $name"
  [ "${3:-}" = -- ] && [ $# -ge 4 ] || usage "exec: want 'exec NAME I -- CMD...'"
  shift 3
  # its own host name too (a UTS namespace): Open MPI names session folders and hosts by it
  exec ip netns exec "$(host "$name" "$k")" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$(host "$name" "$k")" "$@"
}

# Open MPI's remote agent (plm_rsh_agent), called as `AGENT HOST COMMAND...` with HOST one of
# the cluster's addresses; like ssh, the command is one string for a shell.
cmd_agent() {
  local name=$1 a=${2:-} k; need_cluster "$name"; shift 2
  k=$(( ${a##*.} - 1 ))
  [[ $a =~ ^[0-9.]+$ ]] && [ "$k" -ge 0 ] && [ "$k" -lt "$(n_hosts "$name")" ] && [ "$(addr "$name" "$k")" = "$a" ] ||
    die "agent: $a is no host of cluster $name"
  cmd_exec "$name" "$k" -- sh -c "$*"
}

mpirun_args() {
  local name=$1 per=$2 k hosts="" net; net=$(subnet "$name")
  for ((k = 0; k < $(n_hosts "$name"); k++)); do hosts+="${hosts:+,}$(addr "$name" "$k"):$per"; done
  # TCP between hosts on the cluster's subnet only, shared memory (vader) inside one
  echo "--mca plm_rsh_agent '$SELF agent $name' -H $hosts --mca btl tcp,self,vader" \
       "--mca btl_tcp_if_include $net --mca oob_tcp_if_include $net"
}

per_host() {
  local per=1
  if [ "${1:-}" = --per-host ]; then per=${2:-}; [[ $per =~ ^[0-9]+$ ]] && [ "$per" -ge 1 ] || usage "--per-host '$per': want a number"; fi
  echo "$per"
}

cmd_run() {
  local name=$1 per=1; shift; need_cluster "$name"
  [ "${1:-}" = --per-host ] && { per=$(per_host "$@"); shift 2; }
  [ "${1:-}" = -- ] && [ $# -ge 2 ] || usage "run: want 'run NAME [--per-host K] -- MPIRUN_ARGS...'"
  shift
  echo "cluster $name: $(describe "$name")" >&2
  # the namespaces need root, so the ranks run as root: Open MPI wants that confirmed
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  eval "set -- $(mpirun_args "$name" "$per") $(printf '%q ' "$@")"
  cmd_exec "$name" 0 -- mpirun "$@"
}

main() {
  local cmd=${1:-}; shift || true
  case $cmd in
    check) cmd_check ;;
    up|down|info|measure|exec|agent|run|mpirun-args)
      [ $# -ge 1 ] || usage "$cmd needs a cluster name"
      case $cmd in
        up) cmd_up "$@" ;;
        down) cmd_down "$1" ;;
        info) cmd_info "$1" ;;
        measure) cmd_measure "$@" ;;
        exec) cmd_exec "$@" ;;
        agent) cmd_agent "$@" ;;
        run) cmd_run "$@" ;;
        mpirun-args) need_cluster "$1"; mpirun_args "$1" "$(per_host "${@:2}")" ;;
      esac ;;
    list) cmd_list ;;
    *) usage "unknown command '$cmd' (check, up, down, list, info, measure, exec, run, mpirun-args)" ;;
  esac
}
main "$@"
