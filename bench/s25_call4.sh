#!/usr/bin/env bash
# Session 25, call 4 (one H200): matmul tuning (src/ops/cuda/matmul_tune.cuh) - the GPU training
# tests (the tuned run bitwise the untuned one), what it picks at the post's shapes, and the step
# with and without it.
# Usage: bench/s25_call4.sh BUILD OUTDIR
set -u
B=$1 O=$2
MESHTRAIN_BIN=$B/meshtrain timeout 240 bash tests/gpu/test_train_cuda.sh > $O/train_tests.log 2>&1
grep -E "^FAIL|^ok +matmul|^RESULT" $O/train_tests.log
[ -s data/tinystories/train.bin ] || $B/meshtrain prepare > /dev/null
for ct in 256:128 4096:8; do
  $B/meshtrain train embed_dim=1024 n_heads=8 n_layers=16 context_len=${ct%%:*} batch_size=${ct##*:} device=cuda precision=bf16 steps=3 ckpt_path=none val_batches=1 progress=false 2>&1 | grep -E "^matmul tuning"
done
ROUNDS=2 STEPS=20 CONTEXTS="256:128 1024:32 4096:8" VARIANTS="tuned:$B/meshtrain untuned:$B/meshtrain:MESHTRAIN_MATMUL_TUNE=0" timeout 300 bash bench/step_ab.sh 2>&1 | tail -8
timeout 60 $B/bench/lt_algos_probe 1024 1536 32768 50304 8192 | tail -17
