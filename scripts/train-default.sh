#!/usr/bin/env bash
# `make train`: prepares the mirrored TinyStories text (once), trains the default model,
# draws the run's log as <out_dir>/log.svg, then samples a short story from the
# checkpoint. On a machine whose `nvidia-smi` lists a GPU (and a meshtrain built with
# CUDA) it trains a larger model there (device=cuda, mixed precision); otherwise the
# small model on the CPU cores. Extra key=value arguments go to `meshtrain train` and win
# over the defaults (e.g. steps=50, or device=cpu to keep the CPU model on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./meshtrain
DATA=data/tinystories
if [ ! -s "$DATA/train.bin" ] || [ ! -s "$DATA/val.bin" ] || [ "$DATA/TinyStories-train.head-2MiB.txt" -nt "$DATA/train.bin" ]; then
  "$BIN" prepare input="$DATA/TinyStories-train.head-2MiB.txt" data_dir="$DATA"
fi
device=cpu
for a in "$@"; do [ "${a%%=*}" = device ] && device=${a#*=}; done
if ! printf '%s\n' "$@" | grep -q '^device='; then
  # (outputs captured whole: under pipefail, `cmd | grep -q` fails when grep exits first)
  gpus=$(nvidia-smi -L 2>/dev/null || true)
  build=$("$BIN" help 2>/dev/null || true)
  if [[ $gpus == GPU* && $build == *"built with: cpu, cuda"* ]]; then device=cuda; fi
fi
if [ "$device" = cuda ]; then
  # 69M parameters (51M of them the untied embedding and head) on the GPU: seconds of training
  defaults=(device=cuda embed_dim=512 n_heads=8 n_layers=8 context_len=256 batch_size=32 steps=${GPU_STEPS:-300}
    lr=1e-3 min_lr=1e-4 lr_schedule=cosine warmup_steps=30 grad_clip=1.0 weight_decay=0.1
    val_every=50 val_batches=16 ckpt_every=100 out_dir=runs/default)
else
  defaults=(embed_dim=128 n_heads=4 n_layers=4 context_len=128 batch_size=16 steps=500
    lr=3e-3 min_lr=3e-4 lr_schedule=cosine warmup_steps=30 grad_clip=1.0 weight_decay=0.1
    val_every=100 val_batches=16 ckpt_every=100 out_dir=runs/default)
fi
# A key given on the command line replaces the default of the same name.
args=()
for d in "${defaults[@]}"; do
  skip=0
  for a in "$@"; do [ "${a%%=*}" = "${d%%=*}" ] && skip=1; done
  [ $skip -eq 0 ] && args+=("$d")
done
out_dir=runs/default log_file="" model=""
for a in "${args[@]}" "$@"; do
  case "${a%%=*}" in
    out_dir) out_dir=${a#*=} ;;
    log_file) log_file=${a#*=} ;;
    embed_dim|n_heads|n_layers|context_len|batch_size) model="$model ${a}" ;;
  esac
done
"$BIN" train "${args[@]}" "$@"
echo
# The run as a picture beside the checkpoint: loss and validation loss, lr, tokens/s.
echo "--- the run in a picture (meshtrain plot log=<out_dir>/log.jsonl) ---"
"$BIN" plot log="${log_file:-$out_dir/log.jsonl}" out="$out_dir/log.svg" title="make train on $device:$model"
echo
echo "--- sample (meshtrain sample checkpoint=<out_dir>/ckpt.bin) ---"
"$BIN" sample checkpoint="$out_dir/ckpt.bin" prompt="Once upon a time" length=150 temperature=0.7 top_k=40 seed=42 \
  device="$device"
