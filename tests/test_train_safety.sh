#!/usr/bin/env bash
# A run a user can trust: a signal stops it with a checkpoint, everything it will write is
# checked before the first step, bad validation data and non-finite numbers stop it
# cleanly with a valid JSON log, a resume keeps the global batch and the schedule, and an
# error every rank meets is printed once.
TEST_NAME=safety
source "$(dirname "$0")/lib.sh"
use_mpirun
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$TMP"' EXIT  # and the runs still in the background
PY=$(command -v python3)

TINY="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=1 context_len=32 batch_size=4 threads=1 progress=false"
prepare_data 300000 val_fraction=0.1

# every line of a log is a JSON object, without NaN or Infinity (which JSON does not have)
json_valid() {
  "$PY" - "$1" <<'EOF'
import json, sys
def no_constants(c): raise ValueError("non-JSON constant " + c)
for i, line in enumerate(open(sys.argv[1])):
    o = json.loads(line, parse_constant=no_constants)
    assert isinstance(o, dict), "line %d" % (i + 1)
EOF
}
steps_logged() { grep -c '^{"step":[0-9]*,"loss"' "$1" 2>/dev/null; }
# waits (at most 60 s) until the log at $1 has at least $2 step lines
wait_steps() { for _ in $(seq 600); do [ "$(steps_logged "$1")" -ge "$2" ] 2>/dev/null && return 0; sleep 0.1; done; return 1; }
last_step() { grep -o '^{"step":[0-9]*,"loss"' "$1" | tail -1 | grep -o '[0-9]*'; }

# -- 1. the first SIGINT / SIGTERM: the step ends, a checkpoint is written, exit 128+signal
for sig in INT TERM; do
  S=$TMP/sig_$sig
  "$BIN" train $TINY data_dir="$D" steps=100000 out_dir="$S" >"$S.out" 2>"$S.err" & pid=$!
  wait_steps "$S/log.jsonl" 3; kill -$sig $pid; wait $pid; rc=$?
  want=$((128 + $(kill -l $sig)))
  n=$(last_step "$S/log.jsonl")
  if [ $rc -eq $want ] && [ -n "$n" ] && "$BIN" eval checkpoint="$S/ckpt.bin" data_dir="$D" batch_size=4 | grep -q "step $n," &&
     grep -q "\"stopped\":\"SIG$sig\"" "$S/log.jsonl" && grep -q "continue with resume=" "$S.out" && json_valid "$S/log.jsonl"
  then ok "sig${sig,,}_saves_and_exits_$want (step $n)"
  else bad "sig${sig,,}_saves_and_exits_$want (exit $rc, step $n: $(tail -1 "$S.err"))"; fi
done
# the stopped run resumes where it stopped
S=$TMP/sig_INT
n=$(last_step "$S/log.jsonl")
if "$BIN" train resume="$S/ckpt.bin" data_dir="$D" steps=$((n + 2)) out_dir="$S" progress=false >/dev/null &&
   [ "$(last_step "$S/log.jsonl")" = $((n + 2)) ]; then ok resume_after_signal; else bad resume_after_signal; fi

# -- a second signal ends the process at once (the first one is waiting on a hung step)
H=$TMP/hung
MESHTRAIN_FAULT_HANG=0:3 "$BIN" train $TINY data_dir="$D" steps=100 out_dir="$H" >/dev/null 2>&1 & pid=$!
wait_steps "$H/log.jsonl" 2; sleep 0.3; kill -TERM $pid; sleep 0.3; kill -TERM $pid
t0=$SECONDS; wait $pid; rc=$?
[ $rc -eq 143 ] && [ $((SECONDS - t0)) -lt 5 ] && ! [ -e "$H/ckpt.bin" ] && ok second_signal_exits_at_once ||
  bad "second_signal_exits_at_once (exit $rc)"

# -- under mpirun: SIGTERM to every rank (what Slurm's scancel sends a job's tasks): all
# ranks stop after the same step and write their shards. (Open MPI's mpirun, signalled
# itself, tears its runtime down under the ranks: see the README.)
if command -v mpirun >/dev/null; then
  for how in ranks; do
    S=$TMP/sig_mpi_$how
    $MPIRUN -np 2 "$BIN" train $TINY data_dir="$D" steps=100000 out_dir="$S" \
      >"$S.out" 2>"$S.err" & pid=$!
    wait_steps "$S/log.jsonl" 3
    pkill -TERM -P $pid
    wait $pid
    n=$(last_step "$S/log.jsonl"); sh=$(printf 'ckpt.bin.s%08d.r%%d-of-2' "$n")
    if [ -n "$n" ] && [ -e "$S/$(printf "$sh" 0)" ] && [ -e "$S/$(printf "$sh" 1)" ] && grep -q '"stopped":"SIGTERM"' "$S/log.jsonl" &&
       "$BIN" eval checkpoint="$S/ckpt.bin" data_dir="$D" batch_size=4 | grep -q "step $n,"
    then ok "mpirun_signal_saves_$how (step $n)"; else bad "mpirun_signal_saves_$how (step $n: $(ls "$S"; tail -2 "$S.err"))"; fi
  done
fi

# -- 2. what the run will write is checked before the first step
for p in "ckpt_path=/proc/meshtrain/ckpt.bin" "out_dir=/proc/meshtrain" "log_file=/proc/self/nope/log.jsonl"; do
  out=$("$BIN" train $TINY data_dir="$D" steps=3 $p 2>"$TMP/w.err"); rc=$?
  if [ $rc -eq 2 ] && [ "$(grep -c '' "$TMP/w.err")" -eq 1 ] && grep -q "cannot write" "$TMP/w.err" && ! grep -q "^step" <<<"$out"
  then ok "unwritable_${p%%=*}_refused_first"; else bad "unwritable_${p%%=*}_refused_first (exit $rc: $(cat "$TMP/w.err"))"; fi
done

# -- 3. a validation shard with a larger vocabulary than the model's is refused
"$PY" - "$D/train.bin" "$TMP/small_vocab.bin" <<'EOF'
import struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack_from("<Q", raw, 16)[0]
toks = struct.unpack_from("<%dH" % n, raw, 64)
data = struct.pack("<%dH" % n, *[t % 1000 for t in toks])
h = 0xcbf29ce484222325
for b in data: h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
open(sys.argv[2], "wb").write(b"MTSHARD1" + struct.pack("<IIQQ", 1, 1000, n, h) + bytes(32) + data)
EOF
small="vocab_size=1000 embed_dim=32 n_heads=2 n_layers=1 context_len=32 batch_size=4 threads=1 progress=false"
"$BIN" train $small train_data="$TMP/small_vocab.bin" val_data="$TMP/small_vocab.bin" steps=1 out_dir="$TMP/sv" >/dev/null &&
  ok small_vocab_trains || bad small_vocab_trains
err=$("$BIN" train $small train_data="$TMP/small_vocab.bin" val_data="$D/val.bin" steps=2 out_dir="$TMP/bv" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '' <<<"$err")" -eq 1 ] && grep -q "validation data .*50257-token vocabulary" <<<"$err" &&
  ok val_vocab_larger_refused || bad "val_vocab_larger_refused (exit $rc: $err)"

# -- a non-finite loss, training or validation, stops the run (exit 1), keeps the last
# checkpoint and leaves a valid JSON log
for hook in MESHTRAIN_FAULT_NAN_STEP MESHTRAIN_FAULT_NAN_VAL_STEP; do
  N=$TMP/nan_$hook
  env $hook=4 "$BIN" train $TINY data_dir="$D" steps=6 val_every=2 ckpt_every=2 out_dir="$N" >/dev/null 2>"$N.err"; rc=$?
  if [ $rc -eq 1 ] && grep -q "NaN" "$N.err" && json_valid "$N/log.jsonl" && grep -q '"error":"non-finite' "$N/log.jsonl" &&
     "$BIN" eval checkpoint="$N/ckpt.bin" data_dir="$D" batch_size=4 | grep -q "step 2,"
  then ok "${hook#MESHTRAIN_FAULT_}_stops_cleanly"; else bad "${hook#MESHTRAIN_FAULT_}_stops_cleanly (exit $rc: $(cat "$N.err"))"; fi
done

# -- 4. resume on another number of ranks keeps the global batch (8 sequences): 2 ranks of
# 4 for 3 steps, then 1 process, follow one process of 8 for 6 steps
if command -v mpirun >/dev/null; then
  R="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=1 context_len=32 threads=1 progress=false data_dir=$D lr=1e-3"
  "$BIN" train $R batch_size=8 steps=6 out_dir="$TMP/gb_ref" >/dev/null
  $MPIRUN -np 2 "$BIN" train $R batch_size=4 steps=3 out_dir="$TMP/gb" >/dev/null 2>&1
  out=$("$BIN" train resume="$TMP/gb/ckpt.bin" data_dir="$D" steps=6 out_dir="$TMP/gb" progress=false threads=1)
  a=$(grep -o '^{"step":[4-6],"loss":[0-9.]*' "$TMP/gb_ref/log.jsonl" | cut -d: -f3)
  b=$(grep -o '^{"step":[4-6],"loss":[0-9.]*' "$TMP/gb/log.jsonl" | cut -d: -f3)
  if grep -q "global batch: 8 sequences (batch_size 8 x grad_accum_steps 1 x dp 1)" <<<"$out" && [ "$(echo "$b" | wc -l)" -eq 3 ] &&
     paste <(echo "$a") <(echo "$b") | awk '{d=($1-$2)/$1; if (d<0) d=-d; if (d>1e-5) bad=1} END{exit bad}'
  then ok resume_keeps_global_batch; else bad "resume_keeps_global_batch ($a vs $b)"; fi
  # a global batch that does not divide over the ranks: one line, exit 2
  "$BIN" train $R batch_size=3 steps=2 out_dir="$TMP/gb3" >/dev/null
  err=$($MPIRUN -np 2 "$BIN" train resume="$TMP/gb3/ckpt.bin" data_dir="$D" steps=4 out_dir="$TMP/gb3" 2>&1 >/dev/null); rc=$?
  [ $rc -ne 0 ] && [ "$(grep -c '^meshtrain:' <<<"$err")" -eq 1 ] && grep -q "global batch of 3 sequences does not divide over 2" <<<"$err" &&
    ok resume_indivisible_global_batch || bad "resume_indivisible_global_batch (exit $rc: $err)"
fi

# -- a larger steps on resume keeps the schedule's horizon (lr_decay_steps, from the
# checkpoint): steps 11-14 run at min_lr; lr_decay_steps given anew stretches it
C="steps=10 lr=1e-3 min_lr=1e-4 lr_schedule=cosine warmup_steps=2"
"$BIN" train $TINY data_dir="$D" $C out_dir="$TMP/lr" >/dev/null
out=$("$BIN" train resume="$TMP/lr/ckpt.bin" data_dir="$D" steps=14 out_dir="$TMP/lr" progress=false)
lrs=$(grep -o '^{"step":1[1-4],"loss":[0-9.]*,"lr":[0-9.e+-]*' "$TMP/lr/log.jsonl" | grep -o '"lr":.*' | cut -d: -f2 | sort -u)
l10=$(grep -o '^{"step":10,"loss":[0-9.]*,"lr":[0-9.e+-]*' "$TMP/lr/log.jsonl" | grep -o '"lr":.*' | cut -d: -f2)
if [ "$lrs" = "1.000000e-04" ] && awk -v a="$l10" 'BEGIN{exit !(a > 1e-4 && a < 2e-4)}' && grep -q "lr_decay_steps=10" <<<"$out" &&
   grep -q "cosine from 0.001 to 0.0001 at step 10 (lr_decay_steps), then min_lr" <<<"$out"
then ok resume_keeps_lr_horizon; else bad "resume_keeps_lr_horizon (steps 11-14: $lrs; step 10: $l10)"; fi
"$BIN" train $TINY data_dir="$D" $C out_dir="$TMP/lr2" >/dev/null
"$BIN" train resume="$TMP/lr2/ckpt.bin" data_dir="$D" steps=14 lr_decay_steps=20 out_dir="$TMP/lr2" progress=false >/dev/null
l11=$(grep -o '^{"step":11,"loss":[0-9.]*,"lr":[0-9.e+-]*' "$TMP/lr2/log.jsonl" | grep -o '"lr":.*' | cut -d: -f2)
awk -v a="$l11" 'BEGIN{exit !(a > 2e-4)}' && ok lr_decay_steps_given_on_resume || bad "lr_decay_steps_given_on_resume ($l11)"

# -- 5. an error every rank meets is printed once, naming the rank; help on an unknown
# command exits 2
if command -v mpirun >/dev/null; then
  for args in "embed_dimm=3" "$TINY data_dir=$TMP/nowhere" "$TINY data_dir=$D ckpt_path=/proc/meshtrain/ckpt.bin"; do
    err=$($MPIRUN -np 2 "$BIN" train $args 2>&1 >/dev/null); rc=$?
    n=$(grep -c '^meshtrain:' <<<"$err")
    [ $rc -ne 0 ] && [ "$n" -eq 1 ] && grep -q '^meshtrain: rank 0: ' <<<"$err" && ok "error_printed_once (${args##* })" ||
      bad "error_printed_once (${args##* }: exit $rc, $n lines: $err)"
  done
fi
err=$("$BIN" help nosuch 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '' <<<"$err")" -eq 1 ] && grep -q "unknown command 'nosuch'" <<<"$err" && ok help_unknown_command ||
  bad "help_unknown_command (exit $rc: $err)"
"$BIN" help eval | grep -q "context_len=<checkpoint's>" && ok help_eval_context_from_checkpoint || bad help_eval_context_from_checkpoint
"$BIN" help | tail -1 | grep -q "^built with: cpu" && ok help_ends_with_build || bad "help_ends_with_build ($("$BIN" help | tail -1))"

# -- 6. a disk too small for the checkpoint and the log is refused before the first step
# (a 2 MiB tmpfs of our own, removed at the end; needs root to mount)
FS=$TMP/tiny_fs
mkdir -p "$FS"
if mount -t tmpfs -o size=2m tmpfs "$FS" 2>/dev/null; then
  trap 'kill $(jobs -p) 2>/dev/null; umount "$FS" 2>/dev/null; rm -rf "$TMP"' EXIT
  err=$("$BIN" train $TINY data_dir="$D" steps=20 out_dir="$FS/run" 2>&1 >"$TMP/df.out"); rc=$?
  [ $rc -eq 2 ] && [ "$(grep -c '' <<<"$err")" -eq 1 ] && grep -q "not enough disk space in $FS/run: the checkpoint and the log" <<<"$err" &&
    ! grep -q "^step" "$TMP/df.out" && ok disk_full_refused_first || bad "disk_full_refused_first (exit $rc: $err)"
  if command -v mpirun >/dev/null; then  # two ranks' shards of 1.3 MB: each fits alone, both do not
    err=$($MPIRUN -np 2 "$BIN" train vocab_size=1000 embed_dim=80 n_heads=2 n_layers=1 context_len=32 batch_size=4 \
          threads=1 train_data="$TMP/small_vocab.bin" val_data="$TMP/small_vocab.bin" steps=2 fsdp=true \
          ckpt_path="$FS/c/ckpt.bin" out_dir="$TMP/df2" 2>&1 >/dev/null); rc=$?
    [ $rc -eq 2 ] && [ "$(grep -c '^meshtrain:' <<<"$err")" -eq 1 ] && grep -q "2 ranks' shards" <<<"$err" &&
      ok disk_full_counts_every_rank || bad "disk_full_counts_every_rank (exit $rc: $err)"
  fi
  # -- a log write that fails mid-run (the disk fills): one line, exit 1, a checkpoint, no half line
  umount "$FS"; mount -t tmpfs -o size=1m tmpfs "$FS"
  L=$TMP/logfull
  "$BIN" train $TINY data_dir="$D" steps=2000 out_dir="$L" log_file="$FS/log.jsonl" >"$L.out" 2>"$L.err" & pid=$!
  wait_steps "$FS/log.jsonl" 3
  dd if=/dev/zero of="$FS/fill" bs=4k 2>/dev/null
  wait $pid; rc=$?
  n=$(last_step "$FS/log.jsonl")
  if [ $rc -eq 1 ] && [ "$(grep -c '' "$L.err")" -eq 1 ] && grep -q "cannot write the log file .*No space left" "$L.err" &&
     json_valid "$FS/log.jsonl" && [ -n "$n" ] && [ "$n" -lt 2000 ] &&
     "$BIN" eval checkpoint="$L/ckpt.bin" data_dir="$D" batch_size=4 | grep -q "step $((n + 1)),"
  then ok "log_write_failure_stops_with_checkpoint (step $n)"; else bad "log_write_failure_stops_with_checkpoint (exit $rc, step $n: $(cat "$L.err"))"; fi
  rm -f "$FS/fill"
  umount "$FS"
  trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$TMP"' EXIT
else
  echo "skip disk_full_refused_first, log_write_failure_stops_with_checkpoint (cannot mount a tmpfs: not root)"
fi

# -- a log cut mid-line (a killed run) loses the torn line when a resumed run appends to it
T=$TMP/torn
"$BIN" train $TINY data_dir="$D" steps=3 out_dir="$T" >/dev/null
printf '{"step":4,"loss":' >>"$T/log.jsonl"
"$BIN" train resume="$T/ckpt.bin" data_dir="$D" steps=5 out_dir="$T" progress=false >/dev/null &&
  json_valid "$T/log.jsonl" && [ "$(last_step "$T/log.jsonl")" = 5 ] && [ "$(grep -c '"resumed":true' "$T/log.jsonl")" = 1 ] &&
  ok torn_log_line_dropped_on_resume || bad "torn_log_line_dropped_on_resume ($(tail -3 "$T/log.jsonl"))"

# -- memory: ranks on one machine are summed (each fits the fake 300 MB alone, two do not)
if command -v mpirun >/dev/null; then
  err=$(MESHTRAIN_FAKE_MEMAVAILABLE=300000000 $MPIRUN -np 2 -x MESHTRAIN_FAKE_MEMAVAILABLE "$BIN" train vocab_size=50257 \
        embed_dim=64 n_heads=4 n_layers=4 context_len=32 batch_size=8 steps=2 threads=1 ckpt_path=none data_dir="$D" \
        out_dir="$TMP/mem2" 2>&1 >/dev/null); rc=$?
  [ $rc -eq 2 ] && [ "$(grep -c '^meshtrain:' <<<"$err")" -eq 1 ] && grep -q "for the 2 ranks on this machine" <<<"$err" &&
    ok memory_summed_per_machine || bad "memory_summed_per_machine (exit $rc: $err)"
fi
# an activation-bound refusal suggests what shrinks activations, not sharding
err=$(MESHTRAIN_FAKE_MEMAVAILABLE=300000000 "$BIN" train vocab_size=50257 embed_dim=64 n_heads=4 n_layers=4 context_len=512 \
      batch_size=64 steps=1 threads=1 ckpt_path=none data_dir="$D" out_dir="$TMP/mem1" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && grep -q "activation_checkpointing=true" <<<"$err" && ! grep -q "fsdp" <<<"$err" &&
  ok memory_refusal_names_activations || bad "memory_refusal_names_activations (exit $rc: $err)"

# -- a signal during the last step's validation: the run is complete (exit 0), not stopped
# with a resume hint that would have nothing to run; earlier, it stops as any signal does
out=$(MESHTRAIN_FAULT_TERM_VAL_STEP=3 "$BIN" train $TINY data_dir="$D" steps=3 out_dir="$TMP/lv" 2>/dev/null); rc=$?
[ $rc -eq 0 ] && grep -q "after the last step: the run is complete" <<<"$out" && ! grep -q "resume=" <<<"$out" &&
  [ -e "$TMP/lv/ckpt.bin" ] && ok signal_in_final_validation_completes || bad "signal_in_final_validation_completes (exit $rc)"
out=$(MESHTRAIN_FAULT_TERM_VAL_STEP=2 "$BIN" train $TINY data_dir="$D" steps=4 val_every=2 out_dir="$TMP/lv2" 2>/dev/null); rc=$?
[ $rc -eq 143 ] && grep -q "stopped by SIGTERM after step 2 of 4" <<<"$out" && ok signal_in_earlier_validation_stops ||
  bad "signal_in_earlier_validation_stops (exit $rc)"

# -- a resume keeps the run's cadence (val_every) and says when it will train at lr 0
V=$TMP/cad
"$BIN" train $TINY data_dir="$D" steps=4 val_every=2 lr_schedule=cosine lr=1e-3 out_dir="$V" >/dev/null
out=$("$BIN" train resume="$V/ckpt.bin" data_dir="$D" steps=8 out_dir="$V" progress=false)
vals=$(grep -o '^{"step":[0-9]*,"val_loss"' "$V/log.jsonl" | grep -o '[0-9]*' | paste -sd,)
[ "$vals" = "2,4,6,8" ] && ok resume_keeps_val_every || bad "resume_keeps_val_every (validations at steps $vals)"
grep -q "steps to 8 train at learning rate 0" <<<"$out" && ok resume_past_schedule_warns_lr0 || bad resume_past_schedule_warns_lr0
# ... and plot counts every resume, also those that repeated no step
"$BIN" train resume="$V/ckpt.bin" data_dir="$D" steps=9 out_dir="$V" progress=false >/dev/null
"$BIN" plot log="$V/log.jsonl" | grep -q "resumed 2 times" && ok plot_counts_every_resume ||
  bad "plot_counts_every_resume ($("$BIN" plot log="$V/log.jsonl"))"

# -- eval, by default, validates on the batches the run did: its loss is the run's last val_loss
E=$TMP/ev
"$BIN" train $TINY data_dir="$D" steps=2 val_batches=3 out_dir="$E" >/dev/null
a=$(grep -o '"val_loss":[0-9.]*' "$E/log.jsonl" | tail -1 | cut -d: -f2)
b=$("$BIN" eval checkpoint="$E/ckpt.bin" data_dir="$D" | grep -o '^val_loss [0-9.]*' | cut -d' ' -f2)
awk -v a="$a" -v b="$b" 'BEGIN{d=a-b; if (d<0) d=-d; exit !(b != "" && d < 1e-4)}' && ok eval_defaults_to_run_batches ||
  bad "eval_defaults_to_run_batches (run $a, eval $b)"

# -- a constant schedule refuses a warmup longer than the run (as cosine does)
expect_exit 2 "warmup_steps=10 exceeds steps=5" constant_warmup_longer_than_run -- \
  "$BIN" train $TINY data_dir="$D" steps=5 warmup_steps=10 out_dir="$TMP/wu"
echo "RESULT $pass $fail"
