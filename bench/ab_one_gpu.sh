#!/usr/bin/env bash
# Several meshtrain binaries side by side on one GPU at the post's configuration, in one run:
# every binary runs bf16 and mixed (PRECS), REPS rounds, binaries alternating within a
# round (so drift of the card's clocks hits all alike), STEPS timed steps each.
# Usage: REPS=2 STEPS=60 bench/ab_one_gpu.sh build-main/meshtrain build-x/meshtrain ...
# Prints one line per run, then the median tokens/s per binary and precision.
set -u
STEPS=${STEPS:-60}
. "$(dirname "$0")/lib.sh"
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 device=cuda"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
res=$(mktemp)
for ((r = 1; r <= ${REPS:-2}; r++)); do
  for bin in "$@"; do
    for prec in ${PRECS:-bf16 mixed}; do
      out=$(mktemp -d)
      d=$(BIN=$bin mt_run "$out" 1 "" $CFG precision=$prec steps=$((STEPS + 1)) log_every=$STEPS progress=false \
          ckpt_path=none val_batches=1)
      t=$(field tokens_per_s "$d") m=$(field gpu_peak_alloc_bytes "$d")
      [ -n "$t" ] || { echo "$bin $prec: failed: $(mt_failed "$out")"; continue; }
      printf '%-32s %-6s round %d  %8.0f tokens/s  %5.1f GiB\n' "$bin" "$prec" "$r" "$t" "$(awk -v m="$m" 'BEGIN{print m/2^30}')"
      echo "$bin $prec $t" >>"$res"
    done
  done
done
echo "median tokens/s:"
for bin in "$@"; do
  for prec in ${PRECS:-bf16 mixed}; do
    med=$(awk -v b="$bin" -v p="$prec" '$1 == b && $2 == p {print $3}' "$res" | median)
    printf '  %-32s %-6s %s\n' "$bin" "$prec" "${med:-failed}"
  done
done
