#!/usr/bin/env bash
# meshtrain plan and calibrate end to end, without judging any timing: bad cluster
# descriptions are one line and exit 2; calibrate writes a profile the plan then says it
# measured from; every layout's memory is what `meshtrain estimate` prints for its keys, and a
# machine with less memory refuses exactly the layouts whose ranks' estimates add up to more;
# the printed commands run; try= runs the best and folds its step into the profile.
TEST_NAME=plan
source "$(dirname "$0")/lib.sh"
use_mpirun

MODEL="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=1 context_len=32"
PLAN=("$BIN" plan $MODEL global_batch=2)

# -- bad input: one line, exit 2
expect_exit 2 "give global_batch=" no_global_batch -- "$BIN" plan $MODEL devices_per_host=2 host_memory=1GB
expect_exit 2 "describe the cluster: devices_per_host=" no_devices -- "${PLAN[@]}" host_memory=1GB
expect_exit 2 "host_memory= .* is needed" no_host_memory -- "${PLAN[@]}" devices_per_host=2
expect_exit 2 "device=cuda needs device_memory=" cuda_no_device_memory -- "${PLAN[@]}" device=cuda devices_per_host=8 host_memory=1TB
expect_exit 2 "host_memory=12XB: expected a size such as 80GB" bad_size -- "${PLAN[@]}" devices_per_host=2 host_memory=12XB
expect_exit 2 "link_intra=450GB: expected a rate such as 450GB/s" rate_without_per_second -- \
  "${PLAN[@]}" devices_per_host=2 host_memory=1GB link_intra=450GB
expect_exit 2 "cluster=this reads one machine; hosts=2" this_with_hosts -- "${PLAN[@]}" cluster=this hosts=2
expect_exit 2 "cluster=here: expected one of none\|this" bad_cluster -- "${PLAN[@]}" cluster=here
expect_exit 2 "link_inter=0 with hosts=2" no_link_between_hosts -- "${PLAN[@]}" hosts=2 devices_per_host=2 host_memory=1GB link_inter=0
expect_exit 2 "n_heads=3 does not divide embed_dim=32" bad_model -- "$BIN" plan embed_dim=32 n_heads=3 global_batch=2 cluster=this
expect_exit 2 "profile=$TMP/none.txt: " missing_profile -- "${PLAN[@]}" cluster=this profile="$TMP/none.txt"
printf 'device cpu\nop nonsense\n' >"$TMP/bad.txt"
expect_exit 2 "profile=$TMP/bad.txt line 2: not a profile record" bad_profile -- "${PLAN[@]}" cluster=this profile="$TMP/bad.txt"
expect_exit 2 "key 'tensor_parallel_size' does not apply" layout_key_to_plan -- "${PLAN[@]}" cluster=this tensor_parallel_size=2

# -- calibrate: ops at the layouts' shapes, collectives over 2 ranks, into one profile
out=$("$BIN" calibrate $MODEL global_batch=2 devices_per_host=2 out="$TMP/prof.txt" 2>&1)
if [ $? -eq 0 ] && [ "$(grep -c '^op ' "$TMP/prof.txt")" -gt 10 ] && grep -q '^coll allreduce 2 ' "$TMP/prof.txt" &&
   grep -q '^coll sendrecv 2 ' "$TMP/prof.txt" && grep -q '^rate copy ' "$TMP/prof.txt"
then ok calibrate_writes_profile; else bad "calibrate_writes_profile ($(tail -3 <<<"$out"))"; fi

# -- every layout (top=0) on a 2-rank machine with room: costed from measured numbers only
all=$("${PLAN[@]}" devices_per_host=2 host_memory=64GB profile="$TMP/prof.txt" top=0 2>&1)
n=$(grep -c '^ *[0-9]*\. predicted' <<<"$all")
grep -q "layouts: 54 written, 2 refused by the checks a run makes, 0 over memory, 52 feasible" <<<"$all" && [ "$n" = 52 ] &&
  ok "plan_lists_every_layout ($n)" || bad "plan_lists_every_layout ($n; $(grep layouts: <<<"$all"))"
! grep -q " [1-9][0-9]* default" <<<"$all" && grep -q "ops [0-9]* measured, 0 interpolated, 0 default" <<<"$all" &&
  ok plan_uses_measured_numbers || bad "plan_uses_measured_numbers ($(grep -m1 ' default' <<<"$all"))"

# each layout's memory against `meshtrain estimate` of the same keys (threads is train's)
est_total() {  # the largest rank's total: the whole model's, or the largest stage's
  local e; e=$("$BIN" estimate "$@" 2>&1) || { echo "estimate failed: $e"; return; }
  if grep -q '^  stage ' <<<"$e"; then grep -o 'total [0-9.]* [KMG]*i*B' <<<"$(grep '^  stage ' <<<"$e")" | sort -k2 -g | tail -1 | cut -d' ' -f2-
  else grep -E '^  total ' <<<"$e" | awk '{print $2, $3}'; fi
}
mism=0; checked=0
while IFS= read -r head && IFS= read -r _ && IFS= read -r run; do
  mem=$(sed -E 's/.*tokens\/s, ([0-9.]+ [KMG]?i?B) a rank.*/\1/' <<<"$head")
  np=1; [[ $run == *"mpirun -np "* ]] && np=$(sed -E 's/.*mpirun -np ([0-9]+).*/\1/' <<<"$run")
  keys=$(sed -E 's/.* train //; s/ threads=[0-9]+//' <<<"$run")
  e=$(est_total $keys world_size="$np")
  checked=$((checked + 1))
  [ "$e" = "$mem" ] || { mism=$((mism + 1)); echo "  plan $mem, estimate $e: $keys world_size=$np"; }
done < <(grep -A2 '^ *[0-9]*\. predicted' <<<"$all" | grep -v '^--$')
[ "$checked" = 52 ] && [ "$mism" = 0 ] && ok "memory_as_estimate ($checked layouts)" || bad "memory_as_estimate ($mism of $checked differ)"

# a machine with less memory: the layouts over it are marked, the rest listed first
lim=$("${PLAN[@]}" devices_per_host=2 host_memory=170MiB profile="$TMP/prof.txt" top=0 2>&1)
over=$(grep -c '(does not fit)' <<<"$lim")
first_over=$(grep -n '^ *[0-9]*\. predicted' <<<"$lim" | grep -m1 'does not fit' | cut -d. -f1 | tr -dc 0-9)
last_fit=$(grep -n '^ *[0-9]*\. predicted' <<<"$lim" | grep -v 'does not fit' | tail -1 | cut -d: -f2 | cut -d. -f1 | tr -dc 0-9)
grep -q "layouts: 54 written, 2 refused by the checks a run makes, $over over memory" <<<"$lim" && [ "$over" -gt 0 ] &&
  [ "$over" -lt 52 ] && [ "$last_fit" -lt "$first_over" ] && ok "pruned_by_memory ($over over 170 MiB)" ||
  bad "pruned_by_memory ($over over; $(grep layouts: <<<"$lim"))"

# -- the printed commands run: the best one and the best on 2 ranks, one step each
prepare_data 300000
top=$("${PLAN[@]}" devices_per_host=2 host_memory=64GB profile="$TMP/prof.txt" top=0 2>&1)
run1=$(grep '    run: ' <<<"$top" | grep -v mpirun | head -1 | sed 's/    run: //')
run2=$(grep '    run: mpirun -np 2' <<<"$top" | head -1 | sed 's/    run: //')
run2=${run2/mpirun/$MPIRUN}
for r in "$run1" "$run2"; do
  name=printed_command_runs_$(grep -q mpirun <<<"$r" && echo 2 || echo 1)
  o=$(eval "$r data_dir=$D steps=1 out_dir=$TMP/$name ckpt_path=none progress=false" 2>&1)
  [ $? -eq 0 ] && grep -q '"step":1,' "$TMP/$name/log.jsonl" && ok "$name" || bad "$name ($r: $(tail -2 <<<"$o"))"
done

# -- try=1: the best runs, its step goes into the profile, and the next plan shows it
cp "$TMP/prof.txt" "$TMP/prof2.txt"
(cd "$TMP" && "$OLDPWD/$BIN" plan $MODEL global_batch=2 devices_per_host=2 host_memory=64GB profile=prof2.txt top=1 try=1 \
   try_steps=2 data_dir="$D" >"$TMP/try.out" 2>&1)
grep -q "^ 1\. predicted [0-9.]* ms, measured [0-9.]* ms" "$TMP/try.out" && grep -q '^measured ' "$TMP/prof2.txt" &&
  "${PLAN[@]}" devices_per_host=2 host_memory=64GB profile="$TMP/prof2.txt" top=0 | grep -q "measured (try=): " &&
  ok try_folds_into_profile || bad "try_folds_into_profile ($(tail -3 "$TMP/try.out"))"

echo "RESULT $pass $fail"
