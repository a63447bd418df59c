#!/usr/bin/env bash
# Where gradient accumulation's per-token gap goes (issue 18): MESHTRAIN_PROFILE=1's per-op
# totals (every op synchronised; steps 2..STEPS+1) for each config in CFGS, the post's model
# in PREC on one GPU, side by side as ms per step.
# Usage: CFGS="batch_size=128:grad_accum_steps=1 batch_size=32:grad_accum_steps=4" bench/accum_profile.sh
set -u
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain} STEPS=${STEPS:-5}
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=${PREC:-mixed}"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
for cfg in ${CFGS:-batch_size=128:grad_accum_steps=1 batch_size=32:grad_accum_steps=4}; do
  out=$(mktemp -d)
  MESHTRAIN_PROFILE=1 mt_run "$out" 1 "" $POST ${cfg//:/ } steps=$((STEPS + 1)) log_every=$STEPS progress=false \
    ckpt_path=none val_batches=1 >/dev/null
  echo "== $cfg"
  sed -n '/ops profile/,$p' "$out/stdout" | head -40
done
