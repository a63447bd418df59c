#!/usr/bin/env bash
# Session 25, call 2 (one H200): the GPU tests at main, then the step against the compiled peer
# at 1024 x 32 and 10000 x 4 (issue 20, item 4).
# Usage: bench/s25_call2.sh BUILD OUTDIR
set -u
B=$1 O=$2
nvidia-smi --query-gpu=name --format=csv,noheader
OMP_NUM_THREADS=16 timeout 330 scripts/run-tests.sh $B gpu > $O/tests.log 2>&1; echo "tests rc=$?"
grep -E "^FAIL|passed, .* failed$|^== " $O/tests.log | tail -20
MESHTRAIN_BIN=$B/meshtrain CONTEXTS="1024:32 10000:4" MESHTRAIN_POST_RUNS=bf16 PEER_RUNS=compile STEPS=15 timeout 250 bash bench/gpu_long_context.sh build-peers/torch_llama.py > $O/long.log 2>&1
grep -E "^\||^==|^done" $O/long.log
