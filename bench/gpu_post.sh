#!/usr/bin/env bash
# The post's configuration (embed_dim=1024 n_heads=8 n_layers=16 batch_size=128
# context_len=256) on one GPU: meshtrain and the PyTorch peer in the same call, on the
# same card, as one table with the ratios (like with like: meshtrain precision=mixed
# against the peer's compile=1 amp=1, meshtrain precision=bf16 against the peer's
# compile=1, whose default is pure bf16).
# Usage: bench/gpu_post.sh [peer.py] [meshtrain keys...]
# (The peer is ../shared/peers/torch_llama.py; carry a copy when the call runs elsewhere.)
# MESHTRAIN_POST_RUNS="bf16 mixed fp32" and PEER_RUNS="eager compile amp" pick the rows;
# POST_CFG replaces the configuration (bench/gpu_long_context.sh: longer contexts).
# STEPS timed steps each (default 60: meshtrain runs one more and excludes it, the peer runs
# 3 warm-up steps first). Runs of 10 steps end before the cards reach
# their power-limited clocks and flatter both sides (bench/results/one-gpu-post-model-h200-2026-11.md).
set -u
PEER=${1:-../shared/peers/torch_llama.py}; shift || true
CFG=${POST_CFG:-"embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256"}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
STEPS=${STEPS:-60}
. "$(dirname "$0")/lib.sh"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
rows=()
for prec in ${MESHTRAIN_POST_RUNS:-bf16 mixed fp32}; do
  out=$(mktemp -d)
  d=$(mt_run "$out" 1 "" $CFG device=cuda precision=$prec steps=$((STEPS + 1)) log_every=$STEPS progress=false \
      ckpt_path=none "$@")
  grep -E "^step|^done|memory per|total" "$out/stdout" >&2
  tok=$(field tokens_per_s "$d") mem=$(field gpu_peak_alloc_bytes "$d") est=$(field estimate_bytes "$d")
  echo "meshtrain precision=$prec: MFU $(awk -v m="$(field mfu "$d")" 'BEGIN{printf "%.1f%%", 100 * m}')" >&2
  rows+=("meshtrain precision=$prec|${tok:-0}|$(awk -v m="${mem:-0}" 'BEGIN{printf "%.1f", m/1e9}')|$(awk -v e="${est:-0}" 'BEGIN{printf "%.1f", e/1e9}')")
done
for p in ${PEER_RUNS:-eager compile amp}; do
  case $p in eager) extra="";; compile) extra="compile=1";; amp) extra="compile=1 amp=1";; esac
  j=$(python3 "$PEER" $CFG steps=$STEPS warmup=3 $extra 2>&1 | tail -1)
  tok=$(field tokens_per_s "$j") mem=$(field peak_mem_gb "$j")
  rows+=("peer ${extra:-eager}|${tok:-0}|${mem:-0}|")
  [ -n "$tok" ] || echo "peer $extra failed: $j" >&2
done
# ratios against the compiled peers (amp = like with like for mixed; compile = pure bf16)
ref_tok() { for r in "${rows[@]}"; do IFS='|' read -r n t m e <<<"$r"; [ "$n" = "$1" ] && echo "$t $m"; done; }
read -r amp_t amp_m <<<"$(ref_tok "peer compile=1 amp=1")"
read -r cmp_t cmp_m <<<"$(ref_tok "peer compile=1")"
printf "\n| run (%s) | tokens/s | peak GB | estimate GB | vs compile=1 amp=1 (speed, memory) | vs compile=1 (speed, memory) |\n|---|---|---|---|---|---|\n" "$card"
for r in "${rows[@]}"; do
  IFS='|' read -r n t m e <<<"$r"
  ra=$(awk -v t="$t" -v m="$m" -v rt="${amp_t:-0}" -v rm="${amp_m:-0}" 'BEGIN{if(rt>0&&rm>0) printf "%.2fx, %.2fx", t/rt, m/rm; else print "-"}')
  rc=$(awk -v t="$t" -v m="$m" -v rt="${cmp_t:-0}" -v rm="${cmp_m:-0}" 'BEGIN{if(rt>0&&rm>0) printf "%.2fx, %.2fx", t/rt, m/rm; else print "-"}')
  printf "| %s | %.0f | %s | %s | %s | %s |\n" "$n" "$t" "$m" "${e:--}" "$ra" "$rc"
done
