#!/usr/bin/env bash
# Session 28, call 4: matmul tuning narrowed to the first choice's own kernel (matmul_tune.cuh).
# 1 the accum3 pair's runs on the test's data, tuned, graphs on and off (before: 36 of 70 tuned
#   runs had another checkpoint); 2 what tuning takes at that config and at the post's model
#   (MESHTRAIN_MATMUL_TUNE=2); 3 the post's model, mixed, tuned against untuned; 4 gpu_test_ops_cuda.
# Usage: bash bench/s28_call4.sh BUILD   (BUILD holds meshtrain, untuned and tests/)
set -u
B=$1
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(git log -1 --format=%h)"
HEAD=400000 SECS=${SECS:-170} SHOW=3 bash bench/s28_graph_flake.sh "$B" 2>&1 | tail -14
T=$(mktemp -d)
head -c 400000 data/tinystories/TinyStories-train.head-2MiB.txt >"$T/s.txt"
"$B/meshtrain" prepare input="$T/s.txt" data_dir="$T/d" >/dev/null
MESHTRAIN_MATMUL_TUNE=2 "$B/meshtrain" train vocab_size=50257 embed_dim=256 n_heads=4 n_layers=3 context_len=128 \
  lr=1e-3 grad_clip=1 data_dir="$T/d" steps=3 device=cuda precision=mixed grad_accum_steps=3 batch_size=2 \
  progress=false out_dir="$T/v" 2>&1 | grep "matmul tuning"
MESHTRAIN_MATMUL_TUNE=2 "$B/meshtrain" train embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 \
  data_dir=data/tinystories steps=3 device=cuda precision=mixed progress=false val_batches=1 ckpt_path=none out_dir="$T/p" 2>&1 |
  grep "matmul tuning"
PRECS=mixed REPS=2 STEPS=30 bash bench/ab_one_gpu.sh "$B/meshtrain" "$B/untuned" 2>&1 | tail -7
"$B/tests/gpu_test_ops_cuda" 2>&1 | tail -2
