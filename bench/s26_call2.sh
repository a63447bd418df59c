#!/usr/bin/env bash
# Session 26, call 2 (one H200): the small micro-batch's costs op by op. bench_ops_cuda with
# its calls queued, at one layer of the post's model with B = 32 and B = 128 sequences; and
# the host's lead over the GPU in a b32 k4 and a b128 k1 step (MESHTRAIN_TIMELINE_LEADS).
# Usage: bench/s26_call2.sh BUILD OUTDIR
set -u
B=$1 O=$2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in 32 128; do
  BENCH_QUEUED=1 timeout 120 $B/bench/bench_ops_cuda mixed 1024 8 $b 256 > $O/ops_b$b.log 2>&1
done
paste $O/ops_b32.log $O/ops_b128.log | cut -c1-220
[ -s data/tinystories/train.bin ] || $B/meshtrain prepare > /dev/null
for cfg in "batch_size=32 grad_accum_steps=4" "batch_size=128 grad_accum_steps=1"; do
  echo "== $cfg"
  MESHTRAIN_TIMELINE=4 MESHTRAIN_TIMELINE_LEADS=1 timeout 60 $B/meshtrain train embed_dim=1024 n_heads=8 n_layers=16 \
    context_len=256 device=cuda precision=mixed $cfg steps=5 ckpt_path=none val_batches=1 progress=false \
    out_dir=$O/tl > $O/tl_${cfg// /_}.log 2>&1
  grep -i -E "lead|timeline rank 0: step" $O/tl_${cfg// /_}.log | head -20
  grep -c "" $O/tl_${cfg// /_}.log
done
