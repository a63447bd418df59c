#!/usr/bin/env bash
# Layer graphs on a pipeline: bench/gpu_pipeline.sh with cuda_graphs=false and then true on
# every run (the one-GPU reference at the micro-batch size included, so each table's "of
# prediction" compares like with like), no peer. Run after
# tests/gpu/test_multi_gpu.sh's multi_gpu_layer_graphs_bitwise_* cases pass; if graphs win,
# make cuda_graphs=auto take them on several processes too (src/train/train.c's graphs_wanted,
# README "Layer graphs").
# Usage: NP=4 MS="8 32" SCHEDS="1f1b interleaved zb1" BIN=build/meshtrain bench/pp_graphs_ab.sh
set -u
here=$(dirname "$0")
for g in false true; do
  echo "== cuda_graphs=$g"
  GRAPHS=$g NP=${NP:-4} MS=${MS:-8 32} SCHEDS=${SCHEDS:-1f1b interleaved zb1} PEER_SCHEDS= \
    bash "$here/gpu_pipeline.sh" /nonexistent
done
