#!/usr/bin/env bash
# The post's model at longer contexts on one GPU, meshtrain beside the
# compiled peer in the same run: context_len=1024 batch_size=32, 4096 x 8 and 10000 x 4
# (the same tokens per step as the post's 256 x 128, but for the last). Each context is one
# bench/gpu_post.sh table; MFU is in meshtrain's own step lines (stderr).
# Usage: CONTEXTS="1024:32 4096:8 10000:4" MESHTRAIN_POST_RUNS="bf16 mixed" \
#        PEER_RUNS="compile amp" STEPS=20 bench/gpu_long_context.sh [peer.py] [meshtrain keys...]
set -u
export STEPS=${STEPS:-20} MESHTRAIN_POST_RUNS=${MESHTRAIN_POST_RUNS:-"bf16 mixed"} PEER_RUNS=${PEER_RUNS:-"compile amp"}
for ct in ${CONTEXTS:-1024:32 4096:8 10000:4}; do
  T=${ct%%:*} B=${ct##*:}
  echo "== context_len=$T batch_size=$B"
  POST_CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=$B context_len=$T" bash "$(dirname "$0")/gpu_post.sh" "$@"
done
