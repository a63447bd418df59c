#!/usr/bin/env bash
# Loss scaling on CPU ranks (fp32 compute; MESHTRAIN_FAULT_OVERFLOW makes one rank's gradient
# overflow, before any reduction, in chosen steps):
# - an overflow on one rank skips the step on every rank, under DDP, ZeRO-1, ZeRO-2, FSDP,
#   tp 2, pp 2 and offload: the checkpoint after the skipped step 3 holds bitwise the
#   parameters, moments and optimizer step of the run that stopped after step 2 (ckpt_diff -s:
#   only the step, the data position and the last loss differ);
# - the scale's trajectory in the log is PyTorch's (hysteresis 1) and Megatron-LM's
#   (hysteresis 2) over a scripted sequence; a fixed scale skips and never moves; a scale
#   of 2^k trains bitwise as no scale; without a scaler an overflow still stops the run;
# - a run resumed in the middle of a growth window continues bitwise (state, scaler, log);
# - plot draws the scale; bad values are one line and exit 2.
TEST_NAME=loss_scale
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 200000

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D"
LS="loss_scale=dynamic"
# field RUN KEY: KEY of every step line of RUN's log, space-separated
field() { grep '^{"step":[0-9]*,"loss":' "$1/log.jsonl" | grep -o "\"$2\":[^,}]*" | cut -d: -f2 | paste -sd' '; }
# only_position_differs A B: ckpt_diff -s finds nothing but the step, the data position and
# the last loss apart (the parameters, moments and optimizer step bitwise alike)
only_position_differs() {
  local d; d=$("$DIFF" -s "$1" "$2" 2>&1)
  ! grep -vqE '^(step|loader_epoch|loader_window|last_loss): |^state_diff ' <<<"$d" || { echo "  $d" | head -5; return 1; }
}

# -- an overflow on rank 1 in step 3 of 3: every rank skips it
while IFS='|' read -r name np keys; do
  skip_sanitized "$name" && continue
  name=${name#\~}
  a=$TMP/skip_$name; b=$TMP/ref_$name
  if $MPIRUN -np "$np" -x MESHTRAIN_FAULT_OVERFLOW=1:3 "$BIN" train $M $LS batch_size=4 $keys steps=3 out_dir="$a" \
       >"$a.log" 2>&1 &&
     $MPIRUN -np "$np" "$BIN" train $M $LS batch_size=4 $keys steps=2 out_dir="$b" >"$b.log" 2>&1 &&
     [ "$(field "$a" skipped)" = "false false true" ] && only_position_differs "$a/ckpt.bin" "$b/ckpt.bin"
  then ok "skip_everywhere_$name"
  else bad "skip_everywhere_$name (skipped: $(field "$a" skipped); $(tail -1 "$a.log"))"; fi
done <<'CASES'
ddp|2|
~zero1|2|zero_opt=true
zero2|2|fsdp=true shard_strategy=grad_op
~fsdp|2|fsdp=true
tp2|2|tensor_parallel_size=2
pp2|2|pipeline_parallel_size=2 micro_batches=2
~ddp_offload|2|offload=optimizer
~fsdp_offload_params|2|fsdp=true offload=params
CASES

# -- the trajectory over a scripted sequence (window 3): steps 4, 5, 8, 13 and 15 overflow.
# PyTorch's GradScaler (hysteresis 1) and Megatron-LM's DynamicGradScaler (hysteresis 2), the
# scale each step used, as tests/test_loss_scale.c derives them from their update rules
SEQ=4,5,8,13,15
env MESHTRAIN_FAULT_OVERFLOW=0:$SEQ "$BIN" train $M $LS batch_size=2 steps=15 loss_scale_window=3 ckpt_path=none \
  out_dir="$TMP/py" >"$TMP/py.log" 2>&1
want="65536 65536 65536 131072 65536 32768 32768 32768 16384 16384 16384 32768 32768 16384 16384"
[ "$(field "$TMP/py" loss_scale)" = "$want" ] && ok pytorch_trajectory || bad "pytorch_trajectory ($(field "$TMP/py" loss_scale))"
[ "$(field "$TMP/py" skipped | tr ' ' '\n' | grep -n true | cut -d: -f1 | paste -sd,)" = "$SEQ" ] &&
  grep -q '"skipped_steps":5,"loss_scale":8192,' "$TMP/py/log.jsonl" && grep -q "5 steps skipped" "$TMP/py.log" &&
  ok skipped_steps_counted || bad "skipped_steps_counted ($(field "$TMP/py" skipped))"
env MESHTRAIN_FAULT_OVERFLOW=0:$SEQ "$BIN" train $M $LS batch_size=2 steps=15 loss_scale_window=3 loss_scale_hysteresis=2 \
  ckpt_path=none out_dir="$TMP/mg" >"$TMP/mg.log" 2>&1
want="65536 65536 65536 131072 131072 65536 65536 65536 32768 32768 32768 65536 65536 65536 65536"
[ "$(field "$TMP/mg" loss_scale)" = "$want" ] && ok megatron_trajectory || bad "megatron_trajectory ($(field "$TMP/mg" loss_scale))"
# a skipped step advances neither the optimizer's step nor the schedule: with a warmup, the
# step after an overflow takes the rate the skipped one would have had
env MESHTRAIN_FAULT_OVERFLOW=0:2 "$BIN" train $M $LS batch_size=2 steps=4 warmup_steps=4 ckpt_path=none out_dir="$TMP/warm" \
  >"$TMP/warm.log" 2>&1
[ "$(field "$TMP/warm" lr)" = "2.500000e-04 5.000000e-04 5.000000e-04 7.500000e-04" ] && ok schedule_not_advanced ||
  bad "schedule_not_advanced ($(field "$TMP/warm" lr))"

# -- a fixed scale skips an overflow and never moves; a power of two trains bitwise as none
env MESHTRAIN_FAULT_OVERFLOW=0:2 "$BIN" train $M loss_scale=1024 batch_size=2 steps=3 ckpt_path=none out_dir="$TMP/fixed" \
  >"$TMP/fixed.log" 2>&1
[ "$(field "$TMP/fixed" loss_scale)" = "1024 1024 1024" ] && [ "$(field "$TMP/fixed" skipped)" = "false true false" ] &&
  ok fixed_scale || bad "fixed_scale ($(field "$TMP/fixed" loss_scale) / $(field "$TMP/fixed" skipped))"
"$BIN" train $M batch_size=2 steps=3 out_dir="$TMP/none" >/dev/null 2>&1
"$BIN" train $M loss_scale=1024 batch_size=2 steps=3 out_dir="$TMP/pow2" >/dev/null 2>&1
[ "$("$DIFF" -s "$TMP/none/ckpt.bin" "$TMP/pow2/ckpt.bin" 2>&1)" = "state_diff 0" ] && ok power_of_two_scale_is_bitwise_none ||
  bad "power_of_two_scale_is_bitwise_none ($("$DIFF" -s "$TMP/none/ckpt.bin" "$TMP/pow2/ckpt.bin" 2>&1 | head -3))"
# without a scaler an overflow stops the run as a NaN does
expect_exit 1 "step 2: the gradient norm is (infinite|NaN); stopping" no_scaler_stops -- \
  env MESHTRAIN_FAULT_OVERFLOW=0:2 "$BIN" train $M batch_size=2 steps=3 out_dir="$TMP/stop"

# -- resume in the middle of a growth window (window 3; step 2 overflows, 3 and 4 count 2 of
# the 3): steps 5 and 6 bitwise the run straight through, the scaler's file too
F="MESHTRAIN_FAULT_OVERFLOW=0:2"
env $F "$BIN" train $M $LS loss_scale_window=3 batch_size=2 steps=6 out_dir="$TMP/whole" >/dev/null 2>&1
env $F "$BIN" train $M $LS loss_scale_window=3 batch_size=2 steps=4 out_dir="$TMP/part" >/dev/null 2>&1
grep -q '"step":4,.*"loss_scale_growth":2' "$TMP/part/log.jsonl" && ok checkpoint_mid_window || bad checkpoint_mid_window
"$BIN" train resume="$TMP/part/ckpt.bin" steps=6 data_dir="$D" threads=1 progress=false out_dir="$TMP/part" \
  >"$TMP/resume.log" 2>&1
d=$("$DIFF" -s "$TMP/whole/ckpt.bin" "$TMP/part/ckpt.bin" 2>&1)
if [ "$d" = "state_diff 0" ] && cmp -s "$TMP/whole/ckpt.bin.s00000006.lossscale" "$TMP/part/ckpt.bin.s00000006.lossscale" &&
   [ "$(field "$TMP/whole" loss_scale)" = "$(field "$TMP/part" loss_scale)" ] &&
   [ "$(field "$TMP/whole" loss_scale)" = "65536 65536 32768 32768 32768 65536" ]
then ok resume_mid_window_bitwise
else bad "resume_mid_window_bitwise ($d; $(field "$TMP/whole" loss_scale) / $(field "$TMP/part" loss_scale))"; fi
# resumed without the keys: the checkpoint's scaling goes on (its window too)
grep -q "loss scale: dynamic (init 65536), x2 after 3 steps" "$TMP/resume.log" && ok resume_keeps_keys ||
  bad "resume_keeps_keys ($(grep 'loss scale' "$TMP/resume.log"))"

# -- plot: a panel for the scale, a marker per skipped step
if "$BIN" plot log="$TMP/py/log.jsonl" out="$TMP/py.svg" >/dev/null 2>&1 &&
   grep -q 'id="panel-scale"' "$TMP/py.svg" && [ "$(grep -c 'class="skip-marker"' "$TMP/py.svg")" -eq 5 ]
then ok plot_scale_panel; else bad plot_scale_panel; fi
grep -q 'id="panel-scale"' <("$BIN" plot log="$TMP/none/log.jsonl" out=/dev/stdout 2>/dev/null) &&
  bad no_scale_no_panel || ok no_scale_no_panel

# -- bad values: one line, exit 2
T="$BIN train $M batch_size=2 steps=1 out_dir=$TMP/bad"
expect_exit 2 "loss_scale=abc: expected none, dynamic" bad_loss_scale -- $T loss_scale=abc
expect_exit 2 "loss_scale=0: expected" zero_loss_scale -- $T loss_scale=0
expect_exit 2 "loss_scale=-2: expected" negative_loss_scale -- $T loss_scale=-2
expect_exit 2 "loss_scale_window=0: out of range" zero_window -- $T $LS loss_scale_window=0
expect_exit 2 "loss_scale_hysteresis=0: out of range" zero_hysteresis -- $T $LS loss_scale_hysteresis=0
expect_exit 2 "loss_scale_window applies with loss_scale=dynamic" window_without_dynamic -- $T loss_scale_window=10
expect_exit 2 "loss_scale_min applies with loss_scale=dynamic" min_with_fixed -- $T loss_scale=8 loss_scale_min=2
expect_exit 2 "loss_scale_min=1e\+06 exceeds loss_scale_init=65536" min_above_init -- $T $LS loss_scale_min=1e6
expect_exit 2 "precision=fp16 needs a GPU" fp16_on_cpu -- $T precision=fp16
expect_exit 2 "precision=fp16: fp16 compute is not built yet" fp16_on_cuda -- \
  "$BIN" estimate embed_dim=32 n_heads=2 n_layers=2 device=cuda precision=fp16
expect_exit 2 "MESHTRAIN_FAULT_OVERFLOW=1: expected rank:step" bad_hook -- env MESHTRAIN_FAULT_OVERFLOW=1 $T
expect_exit 2 "MESHTRAIN_FAULT_OVERFLOW=0:2,0: expected rank:step" bad_hook_step -- env MESHTRAIN_FAULT_OVERFLOW=0:2,0 $T

echo "RESULT $pass $fail"
[ "$fail" -eq 0 ]
