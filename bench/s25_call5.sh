#!/usr/bin/env bash
# Session 25, call 5 (one H200): the post's model at contexts 256, 1024, 4096 and 10,000 beside the
# compiled peer in the same call, with the matmul tuning (issue 20, items 4 and 5).
# Usage: bench/s25_call5.sh BUILD OUTDIR
set -u
B=$1 O=$2
MESHTRAIN_BIN=$B/meshtrain CONTEXTS="256:128 1024:32 4096:8 10000:4" MESHTRAIN_POST_RUNS=bf16 PEER_RUNS=compile STEPS=15 timeout 560 bash bench/gpu_long_context.sh build-peers/torch_llama.py > $O/long.log 2>&1
grep -E "^\||^==|^done|^matmul tuning" $O/long.log
