#!/usr/bin/env bash
# What the pipeline's send/receive costs the step ("not hidden by compute, under 2%
# of the step"): each schedule in SCHEDS at pp=NP, m=M, the post's model in bf16 (batch 128),
# run as is and with MESHTRAIN_PP_SKIP_COPIES=1 (the same schedule, counters and waits, but no
# byte copied: its results are wrong, its time is the step without the transfers), REPS rounds
# alternating; the exposed share is 1 - tokens/s / tokens/s without the copies (medians).
# Usage: NP=4 M=8 SCHEDS="gpipe 1f1b interleaved zb1" REPS=2 bash bench/pp_exposed.sh [meshtrain]
set -u
NP=${NP:-4} M=${M:-8} STEPS=${STEPS:-20} REPS=${REPS:-2} SCHEDS=${SCHEDS:-gpipe 1f1b interleaved zb1}
BIN=${1:-build/meshtrain}
. "$(dirname "$0")/lib.sh"
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=bf16 batch_size=128"
RUN="steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
res=$(mktemp)
for ((r = 1; r <= REPS; r++)); do
  for s in $SCHEDS; do
    keys=""; [ "$s" = interleaved ] && keys="virtual_stages=2"
    for skip in 0 1; do
      out=$(mktemp -d)
      d=$(mt_run "$out" "$NP" "MESHTRAIN_PP_SKIP_COPIES=$skip" $POST pipeline_parallel_size=$NP micro_batches=$M \
          pipeline_schedule=$s $keys $RUN)
      t=$(field tokens_per_s "$d")
      [ -n "$t" ] || { echo "$s skip=$skip failed: $(mt_failed "$out" 3)"; continue; }
      [ "$skip" = 0 ] || grep -q "MESHTRAIN_PP_SKIP_COPIES=1: the messages are NOT copied" "$out/stdout" ||
        echo "$s: the header does not say the copies were left out"
      printf '%-12s round %d copies %-3s %9.0f tokens/s\n' "$s" "$r" "$([ $skip = 0 ] && echo yes || echo no)" "$t"
      echo "$s $skip $t" >>"$res"
    done
  done
done
echo "medians, and the transfers' share of the step not hidden by compute:"
for s in $SCHEDS; do
  a=$(awk -v s="$s" '$1 == s && $2 == 0 {print $3}' "$res" | median)
  b=$(awk -v s="$s" '$1 == s && $2 == 1 {print $3}' "$res" | median)
  [ -n "$a" ] && [ -n "$b" ] && printf '  %-12s %9.0f with, %9.0f without: %.2f%%\n' "$s" "$a" "$b" \
    "$(awk -v a="$a" -v b="$b" 'BEGIN{print 100 * (1 - a / b)}')"
done
