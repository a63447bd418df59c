#!/usr/bin/env bash
# Session 26, call 1 (one H200): where gradient accumulation's gap at small micro-batches
# goes (bench/accum_profile.sh with CUDA events: b128 k1, b32 k4, b32 k1), and the
# accumulation table at the current commit (matmul tuning on).
# Usage: bench/s26_call1.sh BIN OUTDIR
set -u
B=$1 O=$2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
[ -s data/tinystories/train.bin ] || $B prepare > /dev/null
BIN=$B STEPS=6 CFGS="batch_size=128:grad_accum_steps=1 batch_size=32:grad_accum_steps=4 batch_size=32:grad_accum_steps=1" \
  timeout 200 bash bench/accum_profile.sh > $O/prof.log 2>&1
cat $O/prof.log
REPS=1 STEPS=20 timeout 240 bash bench/accum_one_gpu.sh $B > $O/accum.log 2>&1
cat $O/accum.log
