#!/usr/bin/env bash
# Session 27: rmsnorm at wide rows (embed_dim 4096), two builds side by side on one GPU - the
# ops alone at one GPU's 4,096 rows and a tp=4 rank's 1,024 (bench_ops_cuda, calls queued),
# the GPU op tests of the new build, then the TP-efficiency model's one-GPU step (embed_dim
# 4096, 32 heads, 8 layers, context 4096, batch 1, bf16) under each build, REPS rounds
# alternating.
# Usage: REPS=2 bash bench/s27_norms.sh OLD_BUILD NEW_BUILD   (each holds meshtrain, bench/, tests/)
set -u
A=$1 Bn=$2 STEPS=${STEPS:-15}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
for T in 4096 1024; do
  for b in "$A" "$Bn"; do
    echo "== $b, rows $T"
    BENCH_QUEUED=1 BENCH_OPS=mem "$b/bench/bench_ops_cuda" bf16 4096 32 1 $T 2>&1 | grep -E "rmsnorm"
    BENCH_OPS=rms "$b/bench/bench_ops_cuda" bf16 4096 32 1 $T 2>&1 | tail -1
  done
done
"$Bn/tests/gpu_test_ops_cuda" 2>&1 | grep -E "^ok|^FAIL|RESULT"
"$Bn/tests/gpu_test_ops_bf16" 2>&1 | grep -E "^ok|^FAIL|RESULT"
[ -s data/tinystories/train.bin ] || "$A/meshtrain" prepare >/dev/null
EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1 device=cuda precision=bf16 progress=false"
EFF="$EFF ckpt_path=none val_batches=1 log_every=$STEPS steps=$((STEPS + 1))"
for ((r = 1; r <= ${REPS:-2}; r++)); do
  for b in "$A" "$Bn"; do
    out=$(mktemp -d)
    d=$(BIN=$b/meshtrain mt_run "$out" 1 "" $EFF)
    echo "round $r $b: $(field tokens_per_s "$d") tokens/s, peak $(field gpu_peak_alloc_bytes "$d") bytes"
  done
done
