#!/usr/bin/env bash
# CPU benchmark: training tokens/s and achieved GFLOP/s of the `make train` model, next to
# OpenBLAS's own sgemm GFLOP/s (2048^3, all cores) on the same machine, in the same call.
# Usage: bench/cpu_train.sh [steps]   Prints one Markdown row of
# bench/results/cpu-train-epyc-2core-2026-11.md's table.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
make -s meshtrain build/bench/bench_ops >/dev/null
[ -s data/tinystories/train.bin ] || ./meshtrain prepare >/dev/null
# peak: OpenBLAS's own threads, forward product of the 2048^3 square (the 7th field after the first '|')
peak=$(build/bench/bench_ops | grep "peak (square)" | awk -F'|' '{split($3, a, " "); print a[1]}')
out=$(mktemp -d)
./meshtrain train embed_dim=128 n_heads=4 n_layers=4 context_len=128 batch_size=16 steps="$steps" \
  lr=3e-3 progress=false out_dir="$out" >/dev/null
done_line=$(grep '"done"' "$out/log.jsonl")
tok=$(echo "$done_line" | grep -o '"tokens_per_s":[0-9.]*' | cut -d: -f2)
gf=$(echo "$done_line" | grep -o '"gflops":[0-9.]*' | cut -d: -f2)
rss=$(echo "$done_line" | grep -o '"max_rss_bytes":[0-9]*' | cut -d: -f2)
est=$(echo "$done_line" | grep -o '"estimate_bytes":[0-9]*' | cut -d: -f2)
rm -rf "$out"
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
awk -v d="$(date +%F)" -v cpu="$cpu" -v n="$(nproc)" -v c="$(git rev-parse --short HEAD)" -v s="$steps" \
    -v tok="$tok" -v gf="$gf" -v peak="$peak" -v rss="$rss" -v est="$est" 'BEGIN {
  printf "| %s | %s, %d cores | %s | E128 L4 H4 T128 B16, %d steps | %.0f | %.1f | %.1f | %.2f | %.1f MiB | %.1f MiB |\n",
    d, cpu, n, c, s, tok, gf, peak, gf / peak, rss / 1048576, est / 1048576 }'

