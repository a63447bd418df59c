#!/usr/bin/env bash
# Adafactor against AdamW on the post's model, one GPU: memory, tokens/s
# and the loss after the same number of steps on TinyStories (the same data and seed).
# Usage: STEPS=300 PREC=bf16 bench/gpu_adafactor.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} STEPS=${STEPS:-300}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
POST="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 device=cuda precision=${PREC:-bf16}"
printf '| optimizer | tokens/s | peak GB (estimate) | loss after %d steps | val_loss |\n|---|---|---|---|---|\n' "$STEPS"
for opt in adamw adafactor; do
  out=$(mktemp -d)
  d=$(mt_run "$out" 1 "" $POST optimizer=$opt steps=$STEPS log_every=$STEPS progress=false ckpt_path=none val_batches=8)
  [ -n "$d" ] || { echo "| $opt | failed: $(mt_failed "$out") |"; continue; }
  printf '| %s | %.0f | %.1f (%.1f) | %s | %s |\n' "$opt" "$(field tokens_per_s "$d")" \
    "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')" \
    "$(awk -v m="$(field estimate_bytes "$d")" 'BEGIN{print m/1e9}')" "$(field loss "$d")" "$(field val_loss "$d")"
done
