#!/usr/bin/env bash
# Tensor parallel without sequence parallel, the forward in row groups (MESHTRAIN_TP_OVERLAP,
# issue 19) on the GPUs of one machine, in one call:
#  1. tp = NP follows one GPU in fp32 (tiny model, tied and untied) at 1, 2 and 4 groups
#     (ckpt_diff of the final parameters against the one-GPU run);
#  2. the TP-efficiency model at tp = t for each t in TPS, each group count in GROUP_COUNTS
#     (bench/tp_timeline.sh, sequence parallel off, no profile): tokens/s and where the step goes.
# Usage: NP=4 TPS="2 4" GROUP_COUNTS="1 2 4" bench/tp_overlap.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} NP=${NP:-2}
export MT_TIMEOUT=${MT_TIMEOUT:-120}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
DIFF=$(dirname "$BIN")/tests/ckpt_diff
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 batch_size=8 steps=5 device=cuda precision=fp32 lr=1e-3 grad_clip=1 progress=false"
for tied in false true; do
  "$BIN" train $M tie_embeddings=$tied out_dir=/tmp/tpo_one_$tied >/dev/null 2>&1
  for g in 1 2 4; do
    o=/tmp/tpo_${tied}_$g
    MESHTRAIN_TP_OVERLAP=$g timeout 60 $MPI -np "$NP" -x MESHTRAIN_TP_OVERLAP "$BIN" train $M tie_embeddings=$tied \
      tensor_parallel_size=$NP sequence_parallel=false out_dir=$o >$o.log 2>&1
    echo "tp=$NP tied=$tied groups=$g ($(grep -o 'the forward in [0-9]* groups' $o.log)) vs one GPU: $("$DIFF" /tmp/tpo_one_$tied/ckpt.bin $o/ckpt.bin 2>&1)"
  done
done
v=""; for g in ${GROUP_COUNTS:-1 2 4}; do v="$v${v:+;}MESHTRAIN_TP_OVERLAP=$g"; done
PROFILE=0 TPS="${TPS:-$NP}" SPS=false VARIANTS="$v" bash "$(dirname "$0")/tp_timeline.sh" "$BIN"
