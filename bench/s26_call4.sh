#!/usr/bin/env bash
# Session 26, call 4 (one H200): what launches cost at small batches. bench_ops_cuda at one
# layer of the post's model, B = 4, 32, 128, each op's 20 calls queued back to back against
# the same 20 replayed from a CUDA graph; then the post's step as 128 sequences in k
# micro-batches of 128/k (k = 1, 4, 8, 32) and a step of 4 sequences alone (pipeline
# parallel's one-GPU reference at m = 32).
# Usage: bench/s26_call4.sh BUILD OUTDIR
set -u
B=$1 O=$2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in 4 32 128; do
  BENCH_QUEUED=1 timeout 100 $B/bench/bench_ops_cuda mixed 1024 8 $b 256 > $O/q_b$b.log 2>&1
  BENCH_GRAPH=1 timeout 100 $B/bench/bench_ops_cuda mixed 1024 8 $b 256 > $O/g_b$b.log 2>&1
  echo "== B=$b: queued | graph"
  paste $O/q_b$b.log $O/g_b$b.log | tail -n +2 | awk -F'\t' '{printf "%-75s | %s\n", $1, substr($2, 48)}'
done
[ -s data/tinystories/train.bin ] || $B/meshtrain prepare > /dev/null
BIN=$B/meshtrain
. bench/lib.sh
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=mixed"
for cfg in "batch_size=128 grad_accum_steps=1" "batch_size=32 grad_accum_steps=4" "batch_size=16 grad_accum_steps=8" \
           "batch_size=4 grad_accum_steps=32" "batch_size=4 grad_accum_steps=1"; do
  out=$(mktemp -d)
  d=$(mt_run "$out" 1 "" $POST $cfg steps=21 log_every=20 progress=false ckpt_path=none val_batches=1)
  printf '%-36s %9.0f tokens/s %5.2f GB\n' "$cfg" "$(field tokens_per_s "$d")" \
    "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')"
done
