#!/usr/bin/env bash
# CPU data-parallel benchmark: DDP and FSDP on 1 and 2 ranks (weak scaling: batch_size is
# per rank), and the share of the step blocked on gradient collectives with overlap on and
# off. Ranks share the machine's cores (2 ranks x 1 thread vs 1 rank x 2 threads).
# Usage: bench/cpu_parallel.sh [steps]   Prints Markdown rows of
# bench/results/cpu-data-parallel-epyc-2core-2026-11.md's table.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-10}
make -s meshtrain >/dev/null
[ -s data/tinystories/train.bin ] || ./meshtrain prepare >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
cores=$(nproc)
MODEL="embed_dim=128 n_heads=4 n_layers=4 context_len=128 batch_size=16 steps=$steps lr=3e-3 progress=false"
out=$(mktemp -d)
row() {  # name ranks keys
  local name=$1 np=$2 keys=$3 dir="$out/$1_$2"
  if [ "$np" = 1 ]; then ./meshtrain train $MODEL threads="$cores" $keys out_dir="$dir" >/dev/null
  else mpirun --oversubscribe --bind-to none --stdin none -np "$np" ./meshtrain train $MODEL threads=$((cores / np > 0 ? cores / np : 1)) $keys out_dir="$dir" >/dev/null; fi
  local d; d=$(grep '"done"' "$dir/log.jsonl")
  local tok rss frac
  tok=$(echo "$d" | grep -o '"tokens_per_s":[0-9.]*' | cut -d: -f2)
  rss=$(echo "$d" | grep -o '"max_rss_bytes":[0-9]*' | cut -d: -f2)
  frac=$(echo "$d" | grep -o '"comm_wait_fraction":[0-9.]*' | cut -d: -f2)
  echo "$name|$np|$keys|$tok|$rss|$frac"
}
{
  row ddp 1 ""
  row ddp 2 ""
  row ddp_no_overlap 2 "overlap=false"
  row fsdp 1 "fsdp=true"
  row fsdp 2 "fsdp=true"
  row fsdp_no_overlap 2 "fsdp=true overlap=false"
} > "$out/rows"
base_ddp=$(awk -F'|' '$1=="ddp" && $2==1 {print $4}' "$out/rows")
base_fsdp=$(awk -F'|' '$1=="fsdp" && $2==1 {print $4}' "$out/rows")
commit=$(git rev-parse --short HEAD)
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
while IFS='|' read -r name np keys tok rss frac; do
  base=$base_ddp; [[ $name == fsdp* ]] && base=$base_fsdp
  awk -v d="$(date +%F)" -v cpu="$cpu" -v c="$commit" -v n="$name" -v np="$np" -v k="${keys:-}" -v t="$tok" -v b="$base" \
      -v r="$rss" -v f="$frac" -v cores="$cores" 'BEGIN {
    printf "| %s | %s, %d cores | %s | %s | %d | `%s` | %.0f | %.2f | %.1f%% | %.1f MiB |\n", d, cpu, cores, c, n, np, k, t, t / b, 100 * f, r / 1048576 }'
done < "$out/rows"
rm -rf "$out"
