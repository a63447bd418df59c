#!/usr/bin/env bash
# The post's 7.26B model (embed_dim=4096 n_heads=32 n_layers=48, context 256, pure bf16) on
# 4 GPUs of one machine at a global batch of 32 sequences, in each layout (issue 18):
# FSDP over 4, 4 pipeline stages, 2 stages x 2 data-parallel (DDP, and FSDP), so a user sees
# which to pick: tokens/s and peak memory per GPU (the allocator's high-water mark of the
# fullest rank, and the estimate).
# Usage: bench/gpu_7b_layouts.sh        (LAYOUTS="fsdp4 pp4 pp2dp2 pp2fsdp2 pp4zb1" to choose)
set -u
STEPS=${STEPS:-8} LAYOUTS=${LAYOUTS:-fsdp4 pp4 pp2dp2 pp2fsdp2}
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain}
BIG="embed_dim=4096 n_heads=32 n_layers=48 context_len=256 device=cuda precision=bf16"
RUN="steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x 4"
echo "| layout | keys | tokens/s | MFU | peak GB per GPU (largest rank) | estimate GB |"
echo "|---|---|---|---|---|---|"
for l in $LAYOUTS; do
  case $l in
    fsdp4) keys="batch_size=8 fsdp=true" ;;
    pp4) keys="batch_size=32 pipeline_parallel_size=4 micro_batches=8" ;;
    pp4zb1) keys="batch_size=32 pipeline_parallel_size=4 micro_batches=8 pipeline_schedule=zb1" ;;
    pp4il) keys="batch_size=32 pipeline_parallel_size=4 micro_batches=8 pipeline_schedule=interleaved" ;;
    pp2dp2) keys="batch_size=16 pipeline_parallel_size=2 micro_batches=8" ;;
    pp2fsdp2) keys="batch_size=16 pipeline_parallel_size=2 micro_batches=8 fsdp=true" ;;
  esac
  out=$(mktemp -d)
  d=$(mt_run "$out" 4 "" $BIG $keys $RUN)
  t=$(field tokens_per_s "$d"); [ -n "$t" ] || { echo "| $l | $keys | failed: $(mt_failed "$out" 3) | | | |"; continue; }
  # every rank's peak: the largest (stage lines under pp, else the run's own)
  peak=$(grep -o 'peak GPU memory [0-9.]* [GM]iB' "$out/stdout" | head -1)
  printf '| %s | `%s` | %s | %s | %s | %s |\n' "$l" "$keys" "$t" "$(field mfu "$d")" "$peak" \
    "$(grep -o 'estimate [0-9.]* GiB' "$out/stdout" | head -1)"
  grep "^pipeline stage" "$out/stdout" | sed 's/^/    /'
done
