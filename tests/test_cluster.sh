#!/usr/bin/env bash
# The emulated cluster (scripts/cluster.sh): two hosts on a 100 Mbit/s link measure 50-110%
# of it; 2 ranks, one a host, train as 2 ranks on one host do (losses and parameters), and
# their gradients cross the shaped link; 2 hosts x 2 ranks with the hierarchical all-reduce
# (and the flat one) follow one process, and compressed across the hosts stay near it; the cluster's addresses and devices exist only in
# its namespaces; down removes everything, also with ranks still running and after a crash,
# and an interrupted up removes what it made; a second up of a name is refused; bad input
# is one line and exit 2.
# Needs root and network namespaces: without them it says so in one line and counts as
# skipped. It tests scripts, not memory, so the sanitizer build skips it.
TEST_NAME=cluster
source "$(dirname "$0")/lib.sh"
C=scripts/cluster.sh
[ -z "${MESHTRAIN_SANITIZED:-}" ] || skip_all "test_cluster: the plain build runs it (it tests scripts, not memory)"
why=$($C check 2>&1) || skip_all "test_cluster: $why"
command -v mpirun >/dev/null || skip_all "test_cluster: no mpirun"
use_mpirun

# names of this run only (other runs of the test may share the machine)
N=t$$; N2=i$$; N3=k$$
gone() { [ -z "$(ip netns list | awk '{print $1}' | grep -E "^mt-($N|$N2|$N3)-")" ]; }
trap '$C down $N; $C down $N2; $C down $N3; rm -rf "$TMP"' EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
links_before=$(ip -o link | awk -F': ' '{print $2}' | sort)
addrs_before=$(ip -o addr | awk '{print $2, $4}' | sort)

# -- bad input: one line, exit 2; a missing cluster: one line, exit 1
expect_exit 2 'cluster name' bad_name -- $C up 'No!'
expect_exit 2 "rate 'fast'" bad_rate -- $C up "$N" --rate fast
expect_exit 2 "hosts '0'" bad_hosts -- $C up "$N" --hosts 0
expect_exit 2 'unknown command' bad_command -- $C upp "$N"
expect_exit 1 'no cluster named' no_such_cluster -- $C info "$N"
gone && ok bad_input_makes_nothing || bad bad_input_makes_nothing

# -- a delay needs netem: where the kernel has it the round trip is two delays; where not,
# asking for one is one line and leaves nothing behind
if grep -q 'delay: yes' <<<"$why"; then delay=(--delay 1ms); else
  delay=()
  expect_exit 1 'netem' delay_without_netem_says_so -- $C up "$N" --rate 100mbit --delay 1ms
  gone && ok delay_without_netem_leaves_nothing || bad delay_without_netem_leaves_nothing
fi

# -- two hosts at 100 Mbit/s: the measured bandwidth within 50-110% of the rate
if out=$($C up "$N" --hosts 2 --rate 100mbit "${delay[@]}" 2>&1); then ok up; else bad "up ($out)"; fi
echo "  $out"
mbit=$(grep -o 'measured=[0-9.]*' <<<"$out" | cut -d= -f2)
awk -v m="${mbit:-0}" 'BEGIN {exit !(m >= 50 && m <= 110)}' && ok measured_bandwidth_near_rate ||
  bad "measured_bandwidth_near_rate (${mbit:-none} Mbit/s at 100mbit)"
if [ ${#delay[@]} -gt 0 ]; then
  rtt=$(grep -o 'rtt=[0-9.]*' <<<"$out" | cut -d= -f2)
  awk -v r="${rtt:-0}" 'BEGIN {exit !(r >= 2 && r < 10)}' && ok round_trip_is_two_delays || bad "round_trip_is_two_delays (${rtt:-none} ms)"
fi
# nothing of it in the machine's own namespace
[ "$(ip -o link | awk -F': ' '{print $2}' | sort)" = "$links_before" ] &&
  [ "$(ip -o addr | awk '{print $2, $4}' | sort)" = "$addrs_before" ] && ! ip -o addr | grep -q ' 10\.213\.' &&
  ok nothing_in_root_namespace || bad nothing_in_root_namespace
# a second up of the same name is refused and leaves the first as it was
expect_exit 1 'exists' up_twice_says_so -- $C up "$N" --no-measure
[ "$($C info "$N" 2>&1 | grep -c "mt-$N-h")" = 2 ] && ok up_twice_keeps_the_first || bad up_twice_keeps_the_first

# -- 2 ranks on 2 hosts follow 2 ranks on one host; the gradients cross the shaped link
prepare_data 300000
M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 tie_embeddings=true batch_size=4 data_dir=$D"
$MPIRUN -np 2 "$BIN" train $M out_dir="$TMP/one" </dev/null >"$TMP/one.log" 2>&1
sent() { tc -s -n "mt-$N-h1" qdisc show dev eth0 | awk '/Sent/ {print $2; exit}'; }
before=$(sent)
if $C run "$N" -- --oversubscribe --bind-to none --stdin none -np 2 "$BIN" train $M out_dir="$TMP/two" \
     </dev/null >"$TMP/two.log" 2>&1 && follows "$TMP/one" "$TMP/two"
then ok two_hosts_follow_one_host; else bad "two_hosts_follow_one_host ($(tail -2 "$TMP/two.log" | tr '\n' ' '))"; fi
grep -q "^cluster $N: .*rate=100mbit.*measured=" "$TMP/two.log" && ok run_names_rate_and_measured ||
  bad run_names_rate_and_measured
# the embedding's gradient alone is 6.4 MB a step: 5 steps send well over 10 MB each way
[ $(( $(sent) - ${before:-0} )) -gt 10000000 ] && ok gradients_cross_the_link ||
  bad "gradients_cross_the_link ($(( $(sent) - ${before:-0} )) bytes)"

# -- the hierarchical all-reduce (reduce-scatter inside each host, all-reduce across, all-gather
# inside): 2 hosts x 2 ranks follow one process of the same global batch, as the flat one does
# (dp_allreduce=flat); asked for where dp does not span hosts it is one line and exit 2
"$BIN" train ${M/batch_size=4/batch_size=8} out_dir="$TMP/solo" >/dev/null 2>&1
# (one all-reduce a unit: several in flight at once, their stages begun in one order on every rank)
for mode in hierarchical flat; do
  if $C run "$N" --per-host 2 -- --oversubscribe --bind-to none --stdin none -np 4 "$BIN" train \
       ${M/batch_size=4/batch_size=2} bucket_mb=0 dp_allreduce=$mode out_dir="$TMP/h_$mode" </dev/null >"$TMP/h_$mode.log" 2>&1 &&
     follows "$TMP/solo" "$TMP/h_$mode"
  then ok "dp_allreduce_${mode}_2x2_follows_one_process"
  else bad "dp_allreduce_${mode}_2x2_follows_one_process ($(grep -m1 meshtrain: "$TMP/h_$mode.log"))"; fi
done
# compression on the hop across hosts only: near the uncompressed run, fewer bytes sent
$C run "$N" --per-host 2 -- --oversubscribe --bind-to none --stdin none -np 4 "$BIN" train \
  ${M/batch_size=4/batch_size=2} bucket_mb=0 grad_compression=int8 out_dir="$TMP/h_int8" </dev/null >"$TMP/h_int8.log" 2>&1
cbytes() { grep -o '"comm_bytes":[0-9]*' "$1/log.jsonl" | head -1 | cut -d: -f2; }
grep -q "gradient all-reduce: across machines compressed to int8" "$TMP/h_int8.log" &&
  paste <(losses "$TMP/h_hierarchical") <(losses "$TMP/h_int8") |
    awk '{d=($1-$2)/$1; if (d<0) d=-d; if (d>1e-3) bad=1; n++} END{exit bad || n < 5}' &&
  [ "$(cbytes "$TMP/h_int8")" -lt "$(cbytes "$TMP/h_hierarchical")" ] && ok int8_across_hosts_near_uncompressed ||
  bad "int8_across_hosts_near_uncompressed ($(grep -m1 meshtrain: "$TMP/h_int8.log"); bytes $(cbytes "$TMP/h_int8") against $(cbytes "$TMP/h_hierarchical"))"
grep -q "gradient all-reduce: inside each of 2 machines (2 ranks)" "$TMP/h_hierarchical.log" &&
  ! grep -q "gradient all-reduce: inside" "$TMP/h_flat.log" && ok dp_allreduce_header_says_which ||
  bad dp_allreduce_header_says_which
err=$($MPIRUN -np 2 "$BIN" train $M dp_allreduce=hierarchical out_dir="$TMP/h_one" 2>&1 >/dev/null </dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^meshtrain:' <<<"$err")" = 1 ] && grep -q "do not span several machines" <<<"$err" &&
  ok dp_allreduce_hierarchical_on_one_host_refused || bad "dp_allreduce_hierarchical_on_one_host_refused (exit $rc)"

# -- down with ranks still running ends them and removes everything
$C run "$N" -- -np 2 sleep 60 </dev/null >/dev/null 2>&1 &
run_pid=$!
for ((i = 0; i < 100; i++)); do [ -n "$(ip netns pids "mt-$N-h1" 2>/dev/null)" ] && break; sleep 0.05; done
$C down "$N"
for ((i = 0; i < 50; i++)); do kill -0 "$run_pid" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$run_pid" 2>/dev/null && gone && ok down_ends_a_running_job ||
  { bad down_ends_a_running_job; kill "$run_pid" 2>/dev/null; }
wait "$run_pid" 2>/dev/null
$C down "$N" && ok down_twice || bad down_twice

# -- an up stopped by ^C removes what it made; one killed outright is removed by down
# A background job of a shell without job control starts with SIGINT ignored, and a shell
# cannot undo an ignore it inherits (this test may itself run under one: CI runs the suites
# side by side): `up` starts through python3, which puts SIGINT back to its default first.
sigint_default() { exec python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' "$@"; }
for sig in INT KILL; do
  name=$([ $sig = INT ] && echo "$N2" || echo "$N3")
  sigint_default $C up "$name" --hosts 32 --no-measure >/dev/null 2>&1 &
  pid=$!
  for ((i = 0; i < 100; i++)); do [ "$(ip netns list | grep -c "^mt-$name-")" -gt 3 ] && break; sleep 0.05; done
  made=$(ip netns list | grep -c "^mt-$name-")
  kill -$sig "$pid"; wait "$pid" 2>/dev/null
  # a command the killed up had started may still be finishing
  [ $sig = KILL ] && { sleep 0.2; $C down "$name"; }
  [ "$made" -gt 3 ] && gone && ok "up_stopped_by_${sig}_leaves_nothing" || bad "up_stopped_by_${sig}_leaves_nothing (made $made)"
done

[ "$(ip -o link | awk -F': ' '{print $2}' | sort)" = "$links_before" ] && gone && ok everything_removed || bad everything_removed
echo "RESULT $pass $fail"
