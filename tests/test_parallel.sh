#!/usr/bin/env bash
# Data parallelism over MPI on CPU ranks: every strategy follows the single-process run
# on the same global batch (losses within 1e-5 relative for 5 steps, same final
# parameters); memory per rank falls as the strategy predicts; checkpoints resume across
# world sizes and strategies; a lost or hung rank ends the job quickly.
TEST_NAME=par
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 400000

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D"
for tied in false true; do
  "$BIN" train $M tie_embeddings=$tied batch_size=8 out_dir="$TMP/ref_$tied" >/dev/null
done
while IFS='|' read -r name np keys; do
  skip_sanitized "$name" && continue; name=${name#\~}  # (~: the plain build only; the code runs sanitized at 2 ranks)
  for tied in false true; do
    [ "$tied" = true ] && [ "$np" = 4 ] && [ "$name" != fsdp ] && continue  # tied: fsdp is the case that matters
    out=$TMP/${name}_${np}_$tied
    if $MPIRUN -np "$np" "$BIN" train $M tie_embeddings=$tied batch_size=$((8 / np)) $keys out_dir="$out" </dev/null \
         >"$out.log" 2>&1 && follows "$TMP/ref_$tied" "$out"
    then ok "${name}_np${np}$([ $tied = true ] && echo _tied)"
    else bad "${name}_np${np}$([ $tied = true ] && echo _tied) ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
  done
done <<'CASES'
ddp|2|
~ddp|4|
zero1|2|zero_opt=true
~zero1|4|zero_opt=true
zero2|2|fsdp=true shard_strategy=grad_op
~zero2|4|fsdp=true shard_strategy=grad_op
fsdp|2|fsdp=true shard_strategy=full
fsdp|4|fsdp=true shard_strategy=full
hybrid|4|fsdp=true shard_strategy=hybrid shard_group_size=2
ddp_no_overlap|2|overlap=false
ddp_bucket|2|bucket_mb=0.1
ddp_unit_buckets|2|bucket_mb=0
~ddp_unit_buckets|4|bucket_mb=0
fsdp_no_overlap|2|fsdp=true overlap=false
CASES

# -- activation checkpointing recomputes exactly what the forward kept: bitwise the same
# losses and parameters, in one process and in FSDP over 2 ranks (tied)
strip() { grep '^{"step":[0-9]*,"loss"' "$1/log.jsonl" | sed 's/,"ms".*//'; }
"$BIN" train $M tie_embeddings=false batch_size=8 activation_checkpointing=true out_dir="$TMP/ac1" >/dev/null 2>&1
$MPIRUN -np 2 "$BIN" train $M tie_embeddings=true batch_size=4 fsdp=true activation_checkpointing=true \
  out_dir="$TMP/ac2" </dev/null >/dev/null 2>&1
if [ -n "$(strip "$TMP/ac1")" ] && [ "$(strip "$TMP/ac1")" = "$(strip "$TMP/ref_false")" ] &&
   cmp -s "$TMP/ac1/ckpt.bin" "$TMP/ref_false/ckpt.bin" &&
   [ -n "$(strip "$TMP/ac2")" ] && [ "$(strip "$TMP/ac2")" = "$(strip "$TMP/fsdp_2_true")" ] &&
   cmp -s "$TMP/ac2/ckpt.bin" "$TMP/fsdp_2_true/ckpt.bin"
then ok activation_checkpointing_bitwise; else bad activation_checkpointing_bitwise; fi
# -- without clipping DDP updates in two parts, the late units first, then the others unit
# by unit on the ops' side queue, which also zeroes their gradients for the next step
# (ddp_step): the parameters equal those of the update in one part, which a clip
# too large to bite (1e9) takes; in one process and on 2 ranks with the embedding rows.
# One all-reduce per unit: the head's and layer 3's are done before the end (units 2..0).
M4="${M/n_layers=2/n_layers=4} bucket_mb=0"
for np in 1 2; do
  if [ "$np" = 1 ]; then run=("$BIN"); else run=($MPIRUN -np "$np" "$BIN"); fi
  for clip in 0 1e9; do
    "${run[@]}" train ${M4/grad_clip=1/grad_clip=$clip} batch_size=$((8 / np)) out_dir="$TMP/split_${np}_$clip" \
      </dev/null >/dev/null 2>&1
  done
  [ -n "$(losses "$TMP/split_${np}_0")" ] && [ "$(losses "$TMP/split_${np}_0")" = "$(losses "$TMP/split_${np}_1e9")" ] &&
    "$DIFF" "$TMP/split_${np}_0/ckpt.bin" "$TMP/split_${np}_1e9/ckpt.bin" | grep -qx 'max_rel_diff 0' \
    && ok "ddp_update_in_two_parts_np$np" || bad "ddp_update_in_two_parts_np$np"
done
# -- a run that saves no checkpoint ends cleanly: nothing is left in flight at exit (FSDP's
# evaluation leaves a prefetched gather behind)
NOCK="vocab_size=50257 embed_dim=128 n_heads=4 n_layers=4 context_len=16 steps=3 progress=false threads=1 val_batches=1 data_dir=$D"
if $MPIRUN -np 4 "$BIN" train $NOCK batch_size=2 fsdp=true ckpt_path=none out_dir="$TMP/nock" </dev/null >"$TMP/nock.log" 2>&1
then ok fsdp_exits_cleanly_without_checkpoint; else bad "fsdp_exits_cleanly_without_checkpoint ($(grep -m1 -i 'signal\|error' "$TMP/nock.log"))"; fi
# -- MESHTRAIN_TIMELINE=2: each rank prints step 2's timeline: every layer's forward and
# backward and every unit's gradient collective (4 layers: 4 + embedding + head = 6), in time order
MESHTRAIN_TIMELINE=2 $MPIRUN -np 2 -x MESHTRAIN_TIMELINE "$BIN" train $NOCK batch_size=2 ckpt_path=none bucket_mb=0 \
  out_dir="$TMP/tl" </dev/null >"$TMP/tl.log" 2>&1
tl_ok=1
for r in 0 1; do
  lines=$(grep "^timeline rank $r:" "$TMP/tl.log")
  [ "$(grep -c 'layer [0-9] backward' <<<"$lines")" = 4 ] && [ "$(grep -c 'layer [0-9] forward' <<<"$lines")" = 4 ] &&
    [ "$(grep -c 'gradient all-reduce' <<<"$lines")" = 6 ] &&
    grep -q 'step starts' <<<"$lines" && grep -q 'optimizer step' <<<"$lines" || tl_ok=0
  # in time order
  sort -c -g -k4,4 <(grep -o 'rank [0-9]*: *[0-9.]*' <<<"$lines" | awk '{print $1, $2, $3, $3}') 2>/dev/null || tl_ok=0
done
[ "$tl_ok" = 1 ] && ok timeline_per_rank || bad "timeline_per_rank ($(grep -c timeline "$TMP/tl.log") lines)"
# -- bucket_mb joins units finishing one after another: the head and layers 3..1 in one
# all-reduce, started before layer 0's backward (not left to the end of the step); then
# the embedding's, of only the rows the global batch uses (2 ranks x 2 x 16 tokens: at
# most 64 rows of 128 floats, not 50257), and layer 0's (its last gradients come after)
MESHTRAIN_TIMELINE=2 $MPIRUN -np 2 -x MESHTRAIN_TIMELINE "$BIN" train $NOCK batch_size=2 ckpt_path=none bucket_mb=100 \
  out_dir="$TMP/bk" </dev/null >"$TMP/bk.log" 2>&1
n=$(grep -c '^timeline rank 0:.*gradient all-reduce' "$TMP/bk.log")
first=$(grep -m1 -E '^timeline rank 0:.*(gradient all-reduce|layer 0 backward)' "$TMP/bk.log")
why="$n all-reduces"; [[ $first == *all-reduce* ]] || why="$why, the first after layer 0's backward began"
[ "$why" = "3 all-reduces" ] && ok "ddp_bucket_joins_units (3 all-reduces, not 6)" || bad "ddp_bucket_joins_units ($why)"
emb=$(grep -m1 '^timeline rank 0:.*(embedding rows)' "$TMP/bk.log" | grep -o '[0-9.]* MB')
awk -v m="${emb% MB}" 'BEGIN {exit !(m != "" && m + 0 < 0.05)}' && ok "ddp_embedding_rows_only ($emb, the whole unit is 25.7 MB)" ||
  bad "ddp_embedding_rows_only (${emb:-no embedding-rows all-reduce})"

# -- activation checkpointing's estimate has fewer bytes of activations than without it (not
# merely a different number)
EST="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 batch_size=8"
# est_acts KEYS...: the estimate's activations in bytes ("1.4 MiB" -> 1468006)
est_acts() {
  "$BIN" estimate $EST "$@" | awk '$1 == "activations" && NF == 3 {
    m = $3 == "B" ? 1 : $3 == "KiB" ? 1024 : $3 == "MiB" ? 1048576 : $3 == "GiB" ? 1073741824 : $3 == "TiB" ? 1099511627776 : 0
    if (m && $2 ~ /^[0-9.]+$/) printf "%.0f\n", $2 * m }'
}
a1=$(est_acts); a2=$(est_acts activation_checkpointing=true)
[ -n "$a1" ] && [ -n "$a2" ] && [ "$a2" -gt 0 ] && [ "$a2" -lt "$a1" ] && ok "activation_checkpointing_estimate ($a2 < $a1 bytes)" ||
  bad "activation_checkpointing_estimate (${a2:-?} vs ${a1:-?} bytes)"

# -- memory per rank falls as each strategy predicts, and the estimate stays within 10%
# of every rank's max RSS (a model whose state, not the runtime, dominates).
B="vocab_size=50257 embed_dim=128 n_heads=4 n_layers=4 context_len=16 batch_size=2 steps=2 progress=false threads=1 val_batches=1 data_dir=$D"
prev=""
for s in "ddp|" "zero1|zero_opt=true" "zero2|fsdp=true shard_strategy=grad_op" "fsdp|fsdp=true"; do
  name=${s%%|*}; keys=${s#*|}
  $MPIRUN -np 4 "$BIN" train $B $keys out_dir="$TMP/mem_$name" >/dev/null 2>&1
  line=$(grep '"done"' "$TMP/mem_$name/log.jsonl")
  mx=$(echo "$line" | grep -o '"max_rss_bytes":[0-9]*' | cut -d: -f2)
  mn=$(echo "$line" | grep -o '"min_rss_bytes":[0-9]*' | cut -d: -f2)
  est=$(echo "$line" | grep -o '"estimate_bytes":[0-9]*' | cut -d: -f2)
  # (AddressSanitizer's shadow memory and redzones make RSS no measure of the plan)
  if [ -n "${MESHTRAIN_SANITIZED:-}" ]; then :
  elif [ -n "$mx" ] && awk -v a="$mx" -v b="$mn" -v e="$est" 'BEGIN{d1=(e-a)/a; d2=(e-b)/b; if(d1<0)d1=-d1; if(d2<0)d2=-d2; exit !(d1<0.1 && d2<0.1)}'
  then ok "mem_estimate_$name (rss $mn..$mx, estimate $est)"; else bad "mem_estimate_$name (rss $mn..$mx, estimate $est)"; fi
  if [ -n "$prev" ]; then
    awk -v a="$mx" -v p="$prev" 'BEGIN{exit !(a < p)}' && ok "mem_falls_$name ($mx < $prev)" || bad "mem_falls_$name ($mx vs $prev)"
  fi
  prev=$mx
done

# -- resume across world sizes and strategies: 2 ranks of FSDP die after the step-3
# checkpoint; 4 ranks of DDP (batch 1 each: the same global batch) and one process of
# ZeRO-free training each finish the run; both follow the uninterrupted run.
R="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=6 lr=1e-3 progress=false threads=1 val_batches=1 data_dir=$D"
"$BIN" train $R batch_size=4 out_dir="$TMP/straight" >/dev/null
MESHTRAIN_FAULT_NAN_STEP=4 $MPIRUN -np 2 "$BIN" train $R batch_size=2 fsdp=true ckpt_every=3 out_dir="$TMP/cut" >/dev/null 2>&1
for target in "4|batch_size=1" "1|batch_size=4" "2|batch_size=2 zero_opt=true"; do
  np=${target%%|*}; keys=${target#*|}
  out=$TMP/resume_$np
  rm -rf "$out"; mkdir -p "$out"; cp "$TMP"/cut/ckpt.bin* "$out/"
  if [ "$np" = 1 ]; then run=("$BIN"); else run=($MPIRUN -np "$np" "$BIN"); fi
  "${run[@]}" train resume="$out/ckpt.bin" $keys out_dir="$out" data_dir="$D" progress=false threads=1 >"$out.log" 2>&1
  a=$(losses "$TMP/straight" | tail -3); b=$(losses "$out" | tail -3)
  if [ "$(echo "$b" | wc -l)" -eq 3 ] && paste <(echo "$a") <(echo "$b") | awk '{d=($1-$2)/$1; if(d<0)d=-d; if(d>1e-5) bad=1} END{exit bad}' \
     && params_close "$TMP/straight/ckpt.bin" "$out/ckpt.bin"
  then ok "resume_fsdp2_on_${np}_ranks ($keys)"; else bad "resume_fsdp2_on_${np}_ranks ($(tail -1 "$out.log"))"; fi
done
# resumes_bitwise NAME STRAIGHT CUT: 2 ranks resume CUT's step-3 checkpoint and follow the
# uninterrupted run STRAIGHT bitwise (losses of steps 4-6 and the final checkpoint)
resumes_bitwise() {
  local out=$TMP/resume_$1 a b
  rm -rf "$out"; mkdir -p "$out"; cp "$3"/ckpt.bin* "$out/"
  $MPIRUN -np 2 "$BIN" train resume="$out/ckpt.bin" out_dir="$out" data_dir="$D" progress=false threads=1 >/dev/null 2>&1
  a=$(grep '^{"step":[4-6],"loss"' "$2/log.jsonl" | sed 's/,"ms".*//')
  b=$(grep '^{"step":[4-6],"loss"' "$out/log.jsonl" | sed 's/,"ms".*//')
  [ "$(echo "$a" | wc -l)" -eq 3 ] && [ "$a" = "$b" ] && cmp -s "$2/ckpt.bin" "$out/ckpt.bin" && ok "$1" || bad "$1"
}
# on the same layout (2 FSDP ranks) the resumed run is bitwise the uninterrupted one
$MPIRUN -np 2 "$BIN" train $R batch_size=2 fsdp=true out_dir="$TMP/fsdp_straight" >/dev/null 2>&1
resumes_bitwise resume_same_layout_bitwise "$TMP/fsdp_straight" "$TMP/cut"
# ZeRO-1 too: its step-3 checkpoint is written while the parameter all-gathers it started
# are still in flight (they overlap the next forward)
$MPIRUN -np 2 "$BIN" train $R batch_size=2 zero_opt=true out_dir="$TMP/zero_straight" >/dev/null 2>&1
MESHTRAIN_FAULT_NAN_STEP=4 $MPIRUN -np 2 "$BIN" train $R batch_size=2 zero_opt=true ckpt_every=3 out_dir="$TMP/zero_cut" \
  >/dev/null 2>&1
resumes_bitwise resume_zero1_bitwise "$TMP/zero_straight" "$TMP/zero_cut"
# a checkpoint missing one rank's shard names the shard
out=$TMP/missing; mkdir -p "$out"; cp "$TMP"/cut/ckpt.bin* "$out/"; rm "$out"/ckpt.bin.*r1-of-2
err=$("$BIN" train resume="$out/ckpt.bin" batch_size=4 out_dir="$out" data_dir="$D" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && echo "$err" | grep -q "r1-of-2" && ok missing_shard_named || bad "missing_shard_named ($rc: $err)"

# -- a rank that dies, or hangs, ends the whole job within seconds, with a line naming it
t0=$(date +%s)
out=$(MESHTRAIN_FAULT_KILL=1:3 timeout 60 $MPIRUN -np 2 "$BIN" train ${R/steps=6/steps=50} batch_size=2 out_dir="$TMP/kill" 2>&1); rc=$?
t=$(( $(date +%s) - t0 ))
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 30 ] && echo "$out" | grep -q "rank 1.*signal 9" \
  && ok "killed_rank_ends_job (${t}s)" || bad "killed_rank_ends_job (exit $rc after ${t}s)"
t0=$(date +%s)
out=$(MESHTRAIN_FAULT_HANG=1:3 timeout 60 $MPIRUN -np 2 "$BIN" train ${R/steps=6/steps=50} batch_size=2 comm_timeout=3 out_dir="$TMP/hang" 2>&1); rc=$?
t=$(( $(date +%s) - t0 ))
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 30 ] && echo "$out" | grep -q "did not complete within 3 s" \
  && ok "hung_rank_times_out (${t}s)" || bad "hung_rank_times_out (exit $rc after ${t}s)"

# -- a world size that does not divide a unit is padded, not refused: FSDP on 3 ranks of
# batch 2 follows one process of batch 6, the same global batch (losses and parameters)
"$BIN" train $M batch_size=6 out_dir="$TMP/ref_6" >/dev/null
if $MPIRUN -np 3 "$BIN" train $M batch_size=2 fsdp=true out_dir="$TMP/np3" </dev/null >"$TMP/np3.log" 2>&1 &&
   follows "$TMP/ref_6" "$TMP/np3"
then ok world_of_3_pads
else bad "world_of_3_pads ($("$DIFF" "$TMP/ref_6/ckpt.bin" "$TMP/np3/ckpt.bin" 2>&1 | tail -1); $(tail -1 "$TMP/np3.log"))"; fi
echo "RESULT $pass $fail"
