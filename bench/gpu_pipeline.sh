#!/usr/bin/env bash
# Pipeline parallel on NP GPUs of one machine (issue 18), the post's model in pure bf16,
# in one call: meshtrain with each schedule at m micro-batches, one GPU at the micro-batch
# size (for the bubble's prediction: NP x one GPU x m / (m + NP - 1)), and the peer
# (torch.distributed.pipelining) at the same layout.
# Usage: NP=2 M=8 bench/gpu_pipeline.sh [PEER_DIR]   (PEER_DIR holds torch_llama_pp.py)
set -u
NP=${NP:-2} M=${M:-8} STEPS=${STEPS:-20}
PEERS=${1:-../shared/peers}
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain}
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=bf16"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
row() { printf '| %s | %s | %s |\n' "$1" "$2" "$3"; }
out=$(mktemp -d)
d=$(mt_run "$out" 1 "" $POST batch_size=$((128 / M)) steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1)
one=$(field tokens_per_s "$d"); [ -n "$one" ] || echo "one GPU failed: $(mt_failed "$out")"
pred=$(awk -v o="$one" -v p="$NP" -v m="$M" 'BEGIN{printf "%.0f", p * o * m / (m + p - 1)}')
echo "| run | tokens/s | peak GB (largest stage) |"; echo "|---|---|---|"
row "one GPU, batch $((128 / M))" "$one" "-"
for sched in 1f1b gpipe; do
  out=$(mktemp -d)
  d=$(mt_run "$out" "$NP" "" $POST batch_size=128 pipeline_parallel_size=$NP micro_batches=$M pipeline_schedule=$sched \
      steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1)
  t=$(field tokens_per_s "$d"); [ -n "$t" ] || { echo "pp $sched failed: $(mt_failed "$out" 4)"; continue; }
  peak=$(grep "^pipeline stage" "$out/stdout" | head -$NP | tr '\n' ' ')
  row "meshtrain pp=$NP $sched m=$M (bubble predicts $pred)" "$t ($(awk -v t="$t" -v p="$pred" 'BEGIN{printf "%.3f", t/p}') of the prediction)" "$(grep -o '"gpu_peak_alloc_bytes":[0-9]*' "$out/log.jsonl" | cut -d: -f2 | awk '{printf "%.1f", $1/1e9}') (rank 0)"
done
if [ -f "$PEERS/torch_llama_pp.py" ]; then
  p=$(cd "$PEERS" && torchrun --standalone --nproc_per_node="$NP" torch_llama_pp.py embed_dim=1024 n_heads=8 n_layers=16 \
      batch_size=128 context_len=256 micro_batches=$M schedule=1f1b steps=$STEPS 2>&1 | grep '^{' | tail -1)
  row "peer pp=$NP 1f1b m=$M (eager)" "$(field tokens_per_s "$p")" "$(grep -o '"peak[a-z_]*": *[0-9.]*' <<<"$p" | head -1)"
fi
