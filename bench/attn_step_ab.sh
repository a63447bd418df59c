#!/usr/bin/env bash
# The post's model on one GPU at longer contexts with each attention choice in MODES
# (MESHTRAIN_ATTN), one call: tokens/s and peak per run, to see what an attention kernel
# changes in the whole step (issue 20). bf16, STEPS timed steps.
# Usage: CONTEXTS="4096:8 10000:4" MODES="auto wgmma" BIN=build/meshtrain bench/attn_step_ab.sh
set -u
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain} STEPS=${STEPS:-15}
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
for ct in ${CONTEXTS:-4096:8 10000:4}; do
  T=${ct%%:*} B=${ct##*:}
  for mode in ${MODES:-auto wgmma}; do
    MESHTRAIN_ATTN=$mode mt_row "T=$T B=$B MESHTRAIN_ATTN=$mode" 1 embed_dim=1024 n_heads=8 n_layers=16 \
      context_len=$T batch_size=$B device=cuda precision=bf16 steps=$((STEPS + 1)) log_every=$STEPS progress=false \
      ckpt_path=none val_batches=1
  done
done
