#!/usr/bin/env bash
# optimizer=adafactor end to end on CPU ranks: ZeRO-2, FSDP, DDP and pipeline stages over MPI
# follow the single-process run (losses within 1e-5 relative for 5 steps, same final parameters);
# checkpoints resume bitwise on the same layout and closely on another; a checkpoint of one
# optimizer refuses the other; bad keys are one line and exit 2; the estimate counts
# Adafactor's small state. (The update itself: test_optim against a float64 reference;
# its ops: test_ops.)
TEST_NAME=adafactor
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 400000

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 data_dir=$D optimizer=adafactor"
"$BIN" train $M batch_size=8 out_dir="$TMP/ref" >"$TMP/ref.log" 2>&1
[ -n "$(losses "$TMP/ref")" ] && grep -q "optimizer (Adafactor R, C)" "$TMP/ref.log" && ok adafactor_trains ||
  bad "adafactor_trains ($(tail -1 "$TMP/ref.log"))"
while IFS='|' read -r name np keys; do
  out=$TMP/$name
  if $MPIRUN -np "$np" "$BIN" train $M batch_size=$((8 / np)) $keys out_dir="$out" </dev/null >"$out.log" 2>&1 &&
     follows "$TMP/ref" "$out"
  then ok "adafactor_${name}_follows_one_process"
  else bad "adafactor_${name}_follows_one_process ($("$DIFF" "$TMP/ref/ckpt.bin" "$out/ckpt.bin" 2>&1); $(tail -1 "$out.log"))"; fi
done <<'CASES'
zero2_np2|2|fsdp=true shard_strategy=grad_op
fsdp_np2|2|fsdp=true shard_strategy=full
fsdp_np4|4|fsdp=true shard_strategy=full
ddp_np2|2|
CASES
# the same with a first moment, relative steps and parameter scaling: FSDP on 2 ranks
X="adafactor_beta1=0.9 adafactor_relative_step=true adafactor_scale_parameter=true weight_decay=0.1"
"$BIN" train $M $X batch_size=8 out_dir="$TMP/ref_x" >/dev/null 2>&1
$MPIRUN -np 2 "$BIN" train $M $X batch_size=4 fsdp=true out_dir="$TMP/fsdp_x" </dev/null >"$TMP/fsdp_x.log" 2>&1
follows "$TMP/ref_x" "$TMP/fsdp_x" && ok adafactor_first_moment_relative_fsdp_np2 ||
  bad "adafactor_first_moment_relative_fsdp_np2 ($("$DIFF" "$TMP/ref_x/ckpt.bin" "$TMP/fsdp_x/ckpt.bin" 2>&1))"

# pipeline parallel: 2 stages each run their tensors' update (a tied embedding's copy on
# the last stage too, from the same summed gradient)
for tied in false true; do
  "$BIN" train $M tie_embeddings=$tied batch_size=8 out_dir="$TMP/ref_pp_$tied" >/dev/null 2>&1
  out=$TMP/pp_$tied
  $MPIRUN -np 2 "$BIN" train $M tie_embeddings=$tied batch_size=8 pipeline_parallel_size=2 micro_batches=2 \
    out_dir="$out" </dev/null >"$out.log" 2>&1
  follows "$TMP/ref_pp_$tied" "$out" && ok "adafactor_pipeline_np2$([ $tied = true ] && echo _tied)" ||
    bad "adafactor_pipeline_np2$([ $tied = true ] && echo _tied) ($(tail -1 "$out.log"))"
done

# -- resume: a run cut after its step-3 checkpoint (a NaN at step 4) and resumed to step 6
# is bitwise the uninterrupted one: one process (with a first moment) and 2 FSDP ranks;
# FSDP's checkpoint resumed by one process follows closely (the state is layout-free)
R="${M/steps=5/steps=6}"
strip() { grep '^{"step":[4-6],"loss"' "$1/log.jsonl" | sed 's/,"ms".*//'; }
# resumes NAME NP_CUT NP_RESUME KEYS...: OUT=$TMP/NAME_resume after resuming $TMP/NAME_cut (KEYS on
# each run: the strategy is not in the checkpoint)
resumes() {
  local name=$1 np1=$2 np2=$3 r1 r2; shift 3
  r1=("$BIN"); [ "$np1" -gt 1 ] && r1=($MPIRUN -np "$np1" "$BIN")
  r2=("$BIN"); [ "$np2" -gt 1 ] && r2=($MPIRUN -np "$np2" "$BIN")
  "${r1[@]}" train $R batch_size=$((4 / np1)) "$@" out_dir="$TMP/${name}_straight" </dev/null >/dev/null 2>&1
  MESHTRAIN_FAULT_NAN_STEP=4 "${r1[@]}" train $R batch_size=$((4 / np1)) "$@" ckpt_every=3 out_dir="$TMP/${name}_cut" \
    </dev/null >/dev/null 2>&1
  OUT=$TMP/${name}_resume
  mkdir -p "$OUT"; cp "$TMP/${name}_cut"/ckpt.bin* "$OUT/"
  "${r2[@]}" train resume="$OUT/ckpt.bin" batch_size=$((4 / np2)) "$@" out_dir="$OUT" data_dir="$D" progress=false threads=1 \
    </dev/null >"$OUT.log" 2>&1
}
resumes one 1 1 adafactor_beta1=0.9
[ "$(strip "$TMP/one_straight" | wc -l)" -eq 3 ] && [ "$(strip "$TMP/one_straight")" = "$(strip "$OUT")" ] &&
  cmp -s "$TMP/one_straight/ckpt.bin" "$OUT/ckpt.bin" && ok adafactor_resume_bitwise ||
  bad "adafactor_resume_bitwise ($(tail -1 "$OUT.log"))"
resumes fsdp 2 2 fsdp=true
[ "$(strip "$TMP/fsdp_straight" | wc -l)" -eq 3 ] && [ "$(strip "$TMP/fsdp_straight")" = "$(strip "$OUT")" ] &&
  cmp -s "$TMP/fsdp_straight/ckpt.bin" "$OUT/ckpt.bin" && ok adafactor_resume_fsdp_np2_bitwise ||
  bad "adafactor_resume_fsdp_np2_bitwise ($(tail -1 "$OUT.log"))"
OUT=$TMP/cross; mkdir -p "$OUT"; cp "$TMP/fsdp_cut"/ckpt.bin* "$OUT/"
"$BIN" train resume="$OUT/ckpt.bin" batch_size=4 out_dir="$OUT" data_dir="$D" progress=false threads=1 >"$OUT.log" 2>&1
a=$(losses "$TMP/fsdp_straight" | tail -3); b=$(losses "$OUT" | tail -3)
[ "$(echo "$b" | wc -l)" -eq 3 ] && paste <(echo "$a") <(echo "$b") | awk '{d=($1-$2)/$1; if(d<0)d=-d; if(d>1e-5) bad=1} END{exit bad}' &&
  params_close "$TMP/fsdp_straight/ckpt.bin" "$OUT/ckpt.bin" && ok adafactor_resume_fsdp_np2_on_one_process ||
  bad "adafactor_resume_fsdp_np2_on_one_process ($(tail -1 "$OUT.log"))"

# -- a checkpoint of one optimizer refuses the other; bad values and keys
R2=${R/optimizer=adafactor/}; "$BIN" train ${R2/steps=6/steps=2} batch_size=4 out_dir="$TMP/adamw" >/dev/null 2>&1
expect_exit 2 "optimizer=adafactor cannot resume checkpoint .* which holds adamw state" adamw_checkpoint_refuses_adafactor -- \
  "$BIN" train resume="$TMP/adamw/ckpt.bin" optimizer=adafactor steps=4 data_dir="$D" out_dir="$TMP/x1"
expect_exit 2 "optimizer=adamw cannot resume checkpoint .* which holds adafactor state" adafactor_checkpoint_refuses_adamw -- \
  "$BIN" train resume="$TMP/one_straight/ckpt.bin" optimizer=adamw steps=8 data_dir="$D" out_dir="$TMP/x2"
expect_exit 2 "optimizer=lion: expected one of adamw\|adafactor" unknown_optimizer -- "$BIN" train optimizer=lion
expect_exit 2 "beta1 applies to optimizer=adamw.*adafactor_beta1" adamw_key_with_adafactor -- \
  "$BIN" train optimizer=adafactor beta1=0.5
expect_exit 2 "adafactor_beta1 applies to optimizer=adafactor" adafactor_key_with_adamw -- \
  "$BIN" train optimizer=adamw adafactor_beta1=0.5

# -- the estimate: Adafactor's state is its statistics (rows + cols per matrix), far below
# AdamW's two moments; with a first moment, one moment's worth more
E="vocab_size=50257 embed_dim=256 n_heads=4 n_layers=4 context_len=64 batch_size=4"
opt_bytes() {
  "$BIN" estimate $E "$@" | awk '$1 == "optimizer" {
    m = $NF == "B" ? 1 : $NF == "KiB" ? 1024 : $NF == "MiB" ? 1048576 : $NF == "GiB" ? 1073741824 : 0
    printf "%.0f\n", $(NF-1) * m }'
}
aw=$(opt_bytes); af=$(opt_bytes optimizer=adafactor); am=$(opt_bytes optimizer=adafactor adafactor_beta1=0.9)
[ -n "$af" ] && [ "$af" -gt 0 ] && [ "$((af * 20))" -lt "$aw" ] && [ "$am" -gt "$((aw * 4 / 10))" ] && [ "$am" -lt "$((aw * 6 / 10))" ] &&
  ok "adafactor_estimate ($af B; with beta1 $am B; AdamW $aw B)" || bad "adafactor_estimate ($af, $am vs AdamW $aw)"

echo "RESULT $pass $fail"
[ "$fail" -eq 0 ]
