#!/usr/bin/env bash
# Issue 18's redesign must leave the GPU speed as it was: an A/B of two builds in one call on
# one machine of 2 GPUs, runs alternating (so drift of the cards' clocks hits both alike):
# the post's model on one GPU (bf16, mixed), DDP on 2 GPUs (mixed), FSDP of the 7.26B model
# on 2 GPUs (bf16, batch 8), and gradient accumulation on one GPU (mixed: k=4 x 32 against
# k=1 x 128, the new build only; the old one has no grad_accum_steps).
# Usage: REPS=2 STEPS=30 bench/redesign_ab.sh build-base/meshtrain build/meshtrain
# Prints a line per run, then the medians: tokens/s and peak GB per GPU.
set -u
STEPS=${STEPS:-30}
. "$(dirname "$0")/lib.sh"
A=$1 B=$2
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda"
BIGCFG="embed_dim=4096 n_heads=32 n_layers=48 context_len=256 device=cuda"
[ -s data/tinystories/train.bin ] || "$B" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
res=$(mktemp)
# one NAME NP BIN STEPS KEYS...: a run, its line, and "NAME BIN tokens/s GB" into $res
one() {
  local name=$1 np=$2 bin=$3 steps=$4; shift 4
  local out; out=$(mktemp -d)
  local d; d=$(BIN=$bin mt_run "$out" "$np" "" "$@" steps=$((steps + 1)) log_every=$steps progress=false ckpt_path=none \
    val_batches=1)
  local t m
  t=$(field tokens_per_s "$d") m=$(field gpu_peak_alloc_bytes "$d")
  if [ -z "$t" ]; then echo "$name $bin: failed: $(mt_failed "$out" 3)"; return; fi
  m=$(awk -v m="$m" 'BEGIN{printf "%.1f", m/1e9}')
  printf '%-28s %-24s %9.0f tokens/s %6s GB\n' "$name" "$bin" "$t" "$m"
  echo "$name $bin $t $m" >>"$res"
}
for ((r = 1; r <= ${REPS:-2}; r++)); do
  for bin in "$A" "$B"; do
    one "1gpu-bf16" 1 "$bin" "$STEPS" $POST batch_size=128 precision=bf16
    one "1gpu-mixed" 1 "$bin" "$STEPS" $POST batch_size=128 precision=mixed
    one "ddp2-mixed" 2 "$bin" "$STEPS" $POST batch_size=128 precision=mixed
  done
done
for bin in "$A" "$B"; do one "fsdp2-7B-bf16-b8" 2 "$bin" 8 $BIGCFG batch_size=8 precision=bf16 fsdp=true; done
one "1gpu-mixed-b128-k1" 1 "$B" "$STEPS" $POST batch_size=128 precision=mixed
one "1gpu-mixed-b32-k4" 1 "$B" "$STEPS" $POST batch_size=32 grad_accum_steps=4 precision=mixed
echo
echo "| run | $A | $B | B/A |"
echo "|---|---|---|---|"
for name in $(awk '{print $1}' "$res" | awk '!s[$0]++'); do
  ta=$(awk -v n="$name" -v b="$A" '$1 == n && $2 == b {print $3}' "$res" | median)
  tb=$(awk -v n="$name" -v b="$B" '$1 == n && $2 == b {print $3}' "$res" | median)
  ma=$(awk -v n="$name" -v b="$A" '$1 == n && $2 == b {print $4}' "$res" | head -1)
  mb=$(awk -v n="$name" -v b="$B" '$1 == n && $2 == b {print $4}' "$res" | head -1)
  ratio=$( [ -n "$ta" ] && [ -n "$tb" ] && awk -v a="$ta" -v b="$tb" 'BEGIN{printf "%.3f", b/a}')
  echo "| $name | ${ta:--} (${ma:--} GB) | ${tb:--} (${mb:--} GB) | ${ratio:--} |"
done
