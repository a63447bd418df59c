#!/usr/bin/env bash
# The post's 7.26B model on NP GPUs (default 2) under FSDP, with and without offload:
# tokens/s and GPU memory per rank for today's FSDP in pure bf16 and in mixed
# precision, and mixed with offload=optimizer and offload=params (the offloaded state is the
# rank's shard; the host update runs on each rank's share of the CPU cores). Activation
# checkpointing, batch_size=B per GPU, grad_accum_steps=K, STEPS steps (the first excluded).
# Usage: NP=2 B=8 K=8 STEPS=3 ROWS="bf16 mixed optimizer params" bench/gpu_offload_fsdp.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} NP=${NP:-2} B=${B:-8} K=${K:-8} STEPS=${STEPS:-3}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP; host $(nproc) cores," \
  "$(awk '/MemAvailable/ {printf "%.0f GiB available", $2 / 1048576}' /proc/meminfo)"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
BIG="embed_dim=4096 n_heads=32 n_layers=48 context_len=256 device=cuda fsdp=true shard_strategy=full"
BIG="$BIG activation_checkpointing=true batch_size=$B grad_accum_steps=$K"
RUN="steps=$STEPS log_every=1 progress=false ckpt_path=none val_batches=1"
echo "| FSDP over $NP | tokens/s | MFU | GPU peak per rank GiB (estimate) | host RSS per rank GiB | host update / waited ms a step |"
echo "|---|---|---|---|---|---|"
for r in ${ROWS:-bf16 mixed optimizer params}; do
  case $r in
    bf16) keys="precision=bf16" ;;
    mixed) keys="precision=mixed" ;;
    optimizer) keys="precision=mixed offload=optimizer" ;;
    params) keys="precision=mixed offload=params" ;;
  esac
  out=$(mktemp -d)
  d=$(MT_TIMEOUT=${MT_TIMEOUT:-400} mt_run "$out" "$NP" "" $BIG $keys $RUN)
  [ -n "$d" ] || { echo "| \`$keys\` | failed: $(mt_failed "$out" 2) | | | | |"; continue; }
  printf '| `%s` | %.0f | %.1f%% | %s (%s) | %s | %s / %s |\n' "$keys" "$(field tokens_per_s "$d")" \
    "$(awk -v m="$(field mfu "$d")" 'BEGIN{print 100 * m}')" \
    "$(gib "$(field gpu_peak_alloc_bytes "$d")")" \
    "$(gib "$(field estimate_bytes "$d")")" \
    "$(gib "$(field max_rss_bytes "$d")")" \
    "$(field host_update_ms "$d")" "$(field update_wait_ms "$d")"
done
