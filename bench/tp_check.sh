#!/usr/bin/env bash
# Tensor parallel on NP GPUs in one short run: tp follows one GPU in fp32 (tiny
# model; sequence parallel on and off, tied and untied), then the TP-efficiency and
# long-context rows of bench/gpu_tp.sh for meshtrain only (sequence parallel on and off).
# Usage: NP=2 bench/tp_check.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} NP=${NP:-2} STEPS=${STEPS:-10}
export MT_TIMEOUT=${MT_TIMEOUT:-120}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
DIFF=$(dirname "$BIN")/tests/ckpt_diff
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 batch_size=8 steps=5 device=cuda precision=fp32 lr=1e-3 grad_clip=1 progress=false"
for tied in false true; do
  "$BIN" train $M tie_embeddings=$tied out_dir=/tmp/tpc_one_$tied >/dev/null 2>&1
  for sp in true false; do
    o=/tmp/tpc_${tied}_$sp
    timeout 60 $MPI -np "$NP" "$BIN" train $M tie_embeddings=$tied tensor_parallel_size=$NP sequence_parallel=$sp \
      out_dir=$o >/dev/null 2>&1
    echo "tp=$NP tied=$tied sequence_parallel=$sp vs one GPU: $("$DIFF" /tmp/tpc_one_$tied/ckpt.bin $o/ckpt.bin 2>&1)"
  done
done
C="device=cuda precision=bf16 progress=false ckpt_path=none val_batches=1 log_every=$STEPS steps=$((STEPS + 1))"
row() { local name=$1 np=$2; shift 2; mt_row "$name" "$np" $C "$@"; }  # row NAME NPROC KEYS...
EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1"
row "eff: one GPU" 1 $EFF
row "eff: tp=$NP sequence_parallel=true" "$NP" $EFF tensor_parallel_size=$NP
row "eff: tp=$NP sequence_parallel=false" "$NP" $EFF tensor_parallel_size=$NP sequence_parallel=false
LONG="context_len=10000 embed_dim=1024 n_heads=8 n_layers=16 batch_size=4"
row "long: tp=$NP sequence_parallel=true" "$NP" $LONG tensor_parallel_size=$NP
row "long: tp=$NP sequence_parallel=false" "$NP" $LONG tensor_parallel_size=$NP sequence_parallel=false
