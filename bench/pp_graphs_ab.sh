#!/usr/bin/env bash
# Layer graphs on a pipeline (issue 18, session 26's open question): bench/gpu_pipeline.sh with
# MESHTRAIN_GRAPHS=0 and then =1 on every run (the one-GPU reference at the micro-batch size
# included, so each table's "of prediction" compares like with like), no peer. Run after
# tests/gpu/test_multi_gpu.sh's multi_gpu_layer_graphs_bitwise_* cases pass; if graphs win,
# flip graphs_wanted's default for several processes (src/train/train.c, README "Layer graphs").
# Usage: NP=4 MS="8 32" SCHEDS="1f1b interleaved zb1" BIN=build/meshtrain bench/pp_graphs_ab.sh
set -u
here=$(dirname "$0")
for g in 0 1; do
  echo "== MESHTRAIN_GRAPHS=$g"
  GRAPHS=$g NP=${NP:-4} MS=${MS:-8 32} SCHEDS=${SCHEDS:-1f1b interleaved zb1} PEER_SCHEDS= \
    bash "$here/gpu_pipeline.sh" /nonexistent
done
