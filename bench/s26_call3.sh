#!/usr/bin/env bash
# Session 26, call 3 (one H200): attention at the post's T = 256 with small batches (the
# micro-batches of accumulation and pipelines), each implementation and torch's; then the
# post's step at b32 k4 and b128 k1 with the Hopper backward (RoPE's backward fused) from
# T = 256 (MESHTRAIN_WGMMA_BWD_T=256) against the default (cuDNN's deterministic engine and
# a RoPE pass), runs alternating.
# Usage: bench/s26_call3.sh BUILD OUTDIR
set -u
B=$1 O=$2
timeout 150 bash bench/attn_hopper.sh $B 4:8:256:128 16:8:256:128 32:8:256:128 128:8:256:128 > $O/attn.log 2>&1
tail -12 $O/attn.log
[ -s data/tinystories/train.bin ] || $B/meshtrain prepare > /dev/null
BIN=$B/meshtrain
. bench/lib.sh
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=mixed"
for r in 1 2; do
  for cfg in "batch_size=32 grad_accum_steps=4" "batch_size=128 grad_accum_steps=1"; do
    for env in "X=0" "MESHTRAIN_WGMMA_BWD_T=256"; do
      out=$(mktemp -d)
      d=$(mt_run "$out" 1 "$env" $POST $cfg steps=21 log_every=20 progress=false ckpt_path=none val_batches=1)
      printf '%-36s %-28s round %d %9.0f tokens/s %5.2f GB\n' "$cfg" "$env" $r "$(field tokens_per_s "$d")" \
        "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')"
    done
  done
done
