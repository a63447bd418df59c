#!/usr/bin/env bash
# Gradient accumulation on one GPU: k micro-batches of b against one batch of
# k x b, and one GPU at batch b alone (how much of the gap is the smaller batch's own cost).
# Runs alternate, REPS rounds; medians of tokens/s and peak GB.
# B: the micro-batch (default 32: k=4 against one batch of 128, the post's); PREC: precision.
# Usage: [B=128] [PREC=bf16] REPS=2 STEPS=30 bench/accum_one_gpu.sh build/meshtrain
set -u
STEPS=${STEPS:-30} B=${B:-32}
. "$(dirname "$0")/lib.sh"
BIN=$1
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=${PREC:-mixed}"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
res=$(mktemp)
for ((r = 1; r <= ${REPS:-2}; r++)); do
  for cfg in "batch_size=$((4 * B)) grad_accum_steps=1" "batch_size=$B grad_accum_steps=4" "batch_size=$B grad_accum_steps=1" \
             "batch_size=$((2 * B)) grad_accum_steps=2"; do
    out=$(mktemp -d)
    d=$(mt_run "$out" 1 "" $POST $cfg steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1)
    t=$(field tokens_per_s "$d") m=$(field gpu_peak_alloc_bytes "$d")
    [ -n "$t" ] || { echo "$cfg: failed: $(mt_failed "$out")"; continue; }
    printf '%-36s round %d %9.0f tokens/s %5.1f GB\n' "$cfg" "$r" "$t" "$(awk -v m="$m" 'BEGIN{print m/1e9}')"
    echo "${cfg// /_} $t" >>"$res"
  done
done
echo "median tokens/s:"
for c in $(awk '{print $1}' "$res" | awk '!s[$0]++'); do
  printf '  %-36s %s\n' "${c//_/ }" "$(awk -v c="$c" '$1 == c {print $2}' "$res" | median)"
done
