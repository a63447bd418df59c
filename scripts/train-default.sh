#!/usr/bin/env bash
# `make train`: prepares the mirrored TinyStories text (once), trains the small default
# model on this machine's CPU cores, then samples a short story from the checkpoint.
# Extra key=value arguments go to `meshtrain train` (e.g. scripts/train-default.sh steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./meshtrain
DATA=data/tinystories
if [ ! -s "$DATA/train.bin" ] || [ ! -s "$DATA/val.bin" ] || [ "$DATA/TinyStories-train.head-2MiB.txt" -nt "$DATA/train.bin" ]; then
  "$BIN" prepare input="$DATA/TinyStories-train.head-2MiB.txt" data_dir="$DATA"
fi
defaults=(embed_dim=128 n_heads=4 n_layers=4 context_len=128 batch_size=16 steps=500
  lr=3e-3 min_lr=3e-4 lr_schedule=cosine warmup_steps=30 grad_clip=1.0 weight_decay=0.1
  val_every=100 val_batches=16 ckpt_every=100 out_dir=runs/default)
# A key given on the command line replaces the default of the same name.
args=()
for d in "${defaults[@]}"; do
  skip=0
  for a in "$@"; do [ "${a%%=*}" = "${d%%=*}" ] && skip=1; done
  [ $skip -eq 0 ] && args+=("$d")
done
"$BIN" train "${args[@]}" "$@"
echo
echo "--- sample (meshtrain sample checkpoint=<out_dir>/ckpt.bin) ---"
out_dir=runs/default
for a in "$@"; do [ "${a%%=*}" = out_dir ] && out_dir=${a#*=}; done
"$BIN" sample checkpoint="$out_dir/ckpt.bin" prompt="Once upon a time" length=150 temperature=0.7 top_k=40 seed=42
