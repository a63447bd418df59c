#!/usr/bin/env bash
# The largest model (by parameters) that trains on ONE GPU of this machine with each memory
# setting: embed_dim=4096 n_heads=32 context_len=256 batch_size=B with
# activation checkpointing, n_layers raised by LSTEP while `meshtrain estimate` fits 95% of
# the card (and, with offload, 90% of the host's available memory); then that model runs
# STEPS steps (the first excluded) with grad_accum_steps=K to show it trains: parameters,
# tokens/s, MFU, GPU peak against the estimate, host RSS. Settings (SETTINGS):
#   bf16      precision=bf16, no offload (bf16 weights, gradients and AdamW state)
#   mixed     precision=mixed, no offload
#   adafactor precision=bf16 optimizer=adafactor
#   offload   precision=mixed offload=optimizer (lean: bf16 weights, fp32 gradients on the GPU)
# Usage: SETTINGS="bf16 mixed adafactor offload" B=8 K=4 STEPS=3 bench/gpu_largest.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} B=${B:-8} K=${K:-4} STEPS=${STEPS:-3} LSTEP=${LSTEP:-4}
. "$(dirname "$0")/lib.sh"
card=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)  # MiB
host=$(awk '/MemAvailable/ {print $2 / 1024}' /proc/meminfo)                        # MiB
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $((card / 1024)) GiB; host $(nproc) cores, $(awk -v h="$host" 'BEGIN{printf "%.0f", h / 1024}') GiB available"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
mib() { awk -v v="$1" -v u="$2" 'BEGIN{print u == "TiB" ? v * 1048576 : u == "GiB" ? v * 1024 : u == "MiB" ? v : v / 1024}'; }
echo "| setting | n_layers | parameters | tokens/s | MFU | GPU peak GiB (estimate) | host RSS GiB (pinned estimate) |"
echo "|---|---|---|---|---|---|---|"
for s in ${SETTINGS:-bf16 mixed adafactor offload}; do
  case $s in
    bf16) keys="precision=bf16" ;;
    mixed) keys="precision=mixed" ;;
    adafactor) keys="precision=bf16 optimizer=adafactor" ;;
    offload) keys="precision=mixed offload=optimizer" ;;
  esac
  M="embed_dim=4096 n_heads=32 context_len=256 batch_size=$B device=cuda activation_checkpointing=true $keys"
  best=""
  for ((L = LSTEP; L <= 400; L += LSTEP)); do
    e=$("$BIN" estimate $M n_layers=$L 2>/dev/null)
    g=$(awk '/^  total/ {print $2, $3; exit}' <<<"$e"); [ -n "$g" ] || break
    h=$(grep -o 'host memory per GPU (offload): [0-9.]* [KMGT]iB' <<<"$e" | awk '{print $6, $7}')
    gm=$(mib $g); hm=0; [ -n "$h" ] && hm=$(mib $h)
    awk -v g="$gm" -v c="$card" -v h="$hm" -v a="$host" 'BEGIN{exit !(g < 0.95 * c && h < 0.9 * a)}' || break
    best=$L
  done
  [ -n "$best" ] || { echo "| $s | none fits | | | | | |"; continue; }
  out=$(mktemp -d)
  d=$(mt_run "$out" 1 "" $M n_layers=$best grad_accum_steps=$K steps=$STEPS log_every=1 progress=false ckpt_path=none val_batches=1)
  p=$(grep -o 'parameters: [0-9,]*' "$out/stdout" | head -1 | awk '{print $2}')
  [ -n "$d" ] || { echo "| $s | $best | $p | failed: $(mt_failed "$out" 2) | | | |"; continue; }
  printf '| %s | %s | %s | %.0f | %.1f%% | %s (%s) | %s (%s) |\n' "$s" "$best" "$p" "$(field tokens_per_s "$d")" \
    "$(awk -v m="$(field mfu "$d")" 'BEGIN{print 100 * m}')" \
    "$(gib "$(field gpu_peak_alloc_bytes "$d")")" \
    "$(gib "$(field estimate_bytes "$d")")" \
    "$(gib "$(field max_rss_bytes "$d")")" \
    "$(gib "$(field host_estimate_bytes "$d")")"
done
