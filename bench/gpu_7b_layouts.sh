#!/usr/bin/env bash
# The post's 7.26B model (embed_dim=4096 n_heads=32 n_layers=48, context 256, pure bf16) on
# NP GPUs of one machine (4 or 8) at a global batch of 32 sequences, in each layout:
# on 4, FSDP over 4, 4 pipeline stages, 2 stages x 2 data-parallel (DDP, and FSDP);
# on 8, FSDP over 8, the post's 2D layout (FSDP 4 x TP 2), 2 stages x FSDP 4, and the 3D mesh
# (2 stages x 2 data-parallel x TP 2, with DDP and with FSDP), so a user sees which to pick:
# tokens/s and peak memory per GPU (the allocator's high-water mark of the fullest rank, and the
# estimate).
# Usage: bench/gpu_7b_layouts.sh   (LAYOUTS="fsdp4 pp4 pp2dp2 pp2fsdp2 pp4zb1 pp4il" to choose;
#   NP=8 LAYOUTS="fsdp8 fsdp4tp2 pp2fsdp4 pp2dp2tp2 pp2fsdp2tp2" on 8 GPUs, its default)
set -u
NP=${NP:-4}
if [ "$NP" = 8 ]; then def="fsdp8 fsdp4tp2 pp2fsdp4 pp2dp2tp2 pp2fsdp2tp2"; else def="fsdp4 pp4 pp2dp2 pp2fsdp2"; fi
STEPS=${STEPS:-8} LAYOUTS=${LAYOUTS:-$def}
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain}
BIG="embed_dim=4096 n_heads=32 n_layers=48 context_len=256 device=cuda precision=bf16"
RUN="steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
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
    fsdp8) keys="batch_size=4 fsdp=true" ;;
    fsdp4tp2) keys="batch_size=8 fsdp=true tensor_parallel_size=2" ;;
    pp2fsdp4) keys="batch_size=8 pipeline_parallel_size=2 micro_batches=4 fsdp=true" ;;
    pp2dp2tp2) keys="batch_size=16 pipeline_parallel_size=2 micro_batches=8 tensor_parallel_size=2" ;;
    pp2fsdp2tp2) keys="batch_size=16 pipeline_parallel_size=2 micro_batches=8 tensor_parallel_size=2 fsdp=true" ;;
    *) echo "unknown layout $l"; continue ;;
  esac
  out=$(mktemp -d)
  d=$(mt_run "$out" "$NP" "" $BIG $keys $RUN)
  t=$(field tokens_per_s "$d"); [ -n "$t" ] || { echo "| $l | $keys | failed: $(mt_failed "$out" 3) | | | |"; continue; }
  # every rank's peak: the largest (stage lines under pp, else the run's own)
  peak=$(grep -o 'peak GPU memory [0-9.]* [GM]iB' "$out/stdout" | head -1)
  printf '| %s | `%s` | %s | %s | %s | %s |\n' "$l" "$keys" "$t" "$(field mfu "$d")" "$peak" \
    "$(grep -o 'estimate [0-9.]* GiB' "$out/stdout" | head -1)"
  grep "^pipeline stage" "$out/stdout" | sed 's/^/    /'
done
