#!/usr/bin/env bash
# Data-parallel variants at the post's configuration per GPU, one line each, all in one run
# (so that every figure comes from the same machine). Each argument is
#   "LABEL|NPROC|ENV|KEYS"  e.g. "ddp4 tree|4|NCCL_ALGO=Tree|precision=mixed"
# ENV is a space-separated list of VAR=value passed to every rank (mpirun -x).
# BASE replaces the model and device keys (default: the post's configuration on cuda).
# STEPS (default 30; the first step is not timed) and MESHTRAIN_BIN as in gpu_multi.sh.
# Prints: label, tokens/s, per-GPU tokens/s, peak GiB, host-wait share of the step.
# Usage: STEPS=61 MESHTRAIN_BIN=build/meshtrain bench/ddp_variants.sh "one|1||precision=mixed" \
#          "ddp4|4||precision=mixed" "nccl4|4||precision=mixed copy_engines=false"
set -u
BIN=${MESHTRAIN_BIN:-build/meshtrain}
STEPS=${STEPS:-30}
CFG="${BASE:-embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 device=cuda}"
CFG="$CFG steps=$STEPS log_every=$STEPS progress=false ckpt_path=none val_batches=1"
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
printf '%-36s %12s %12s %8s %6s\n' run tokens/s per-GPU peakGiB wait%
for v in "$@"; do
  IFS='|' read -r label np envs keys <<<"$v"
  out=$(mktemp -d); echo "# $(date +%T) start: $label" >&2
  d=$(mt_run "$out" "$np" "$envs" $CFG $keys)
  if [ -z "$d" ]; then echo "$label: failed: $(mt_failed "$out")"; continue; fi
  awk -v l="$label" -v t="$(field tokens_per_s "$d")" -v n="$np" -v m="$(field gpu_peak_alloc_bytes "$d")" \
    -v w="$(field comm_wait_fraction "$d")" \
    'BEGIN{printf "%-36s %12.0f %12.0f %8.1f %6.1f\n", l, t, t/n, m/2^30, 100*w}'
done
