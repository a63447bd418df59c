#!/usr/bin/env bash
# Mixture of experts on one GPU: meshtrain and the PyTorch peer in the same call, on the same
# card, at the post's shape (embed_dim=1024 n_heads=8 n_layers=16 batch_size=128
# context_len=256), dense and three MoE variants of the dense model's active size:
#   A  16 experts of 512, top 2, one shared expert of 512 (598M total, 246M active)
#   B  8 experts of 768, top 2
#   C  64 experts of 256, top 6
# Like with like: meshtrain precision=bf16 against the peer's compile=1 (pure bf16),
# precision=mixed against compile=1 amp=1. Prints per run tokens/s, the allocator's peak, the
# estimate, MFU of the active parameters and the ratios to the peer; and, for meshtrain, the
# speed with a skewed router (MESHTRAIN_MOE_SKEW: most tokens to the first experts) and the
# load it gave (the log's largest imbalance).
# Usage: bench/gpu_moe.sh [peer.py]     (default ../shared/peers/torch_llama.py; carry a copy
#        when the call runs elsewhere)
# RUNS="dense A B C" picks the variants, PRECS="bf16 mixed" the precisions, PEER_RUN=0 leaves the
# peer out, SKEW=S the skewed runs' bias (0: none; default 300). STEPS timed steps (default 30:
# meshtrain runs one more and excludes it, the peer 3 warm-up steps first).
set -u
PEER=${1:-../shared/peers/torch_llama.py}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
STEPS=${STEPS:-30} RUNS=${RUNS:-dense A B C} PRECS=${PRECS:-bf16} SKEW=${SKEW:-300}
. "$(dirname "$0")/lib.sh"
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256"
mt_keys() {
  case $1 in
    dense) echo "" ;;
    A) echo "moe_experts=16 moe_top_k=2 moe_expert_dim=512 moe_shared_experts=1" ;;
    B) echo "moe_experts=8 moe_top_k=2 moe_expert_dim=768" ;;
    C) echo "moe_experts=64 moe_top_k=6 moe_expert_dim=256" ;;
  esac
}
peer_keys() {
  case $1 in
    dense) echo "" ;;
    A) echo "moe_experts=16 moe_top_k=2 moe_expert_dim=512 moe_shared=1" ;;
    B) echo "moe_experts=8 moe_top_k=2 moe_expert_dim=768" ;;
    C) echo "moe_experts=64 moe_top_k=6 moe_expert_dim=256" ;;
  esac
}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
printf "| run | precision | meshtrain tokens/s | peak GB | estimate GB | MFU | peer tokens/s | peer GB | speed | memory |\n"
printf "|---|---|---|---|---|---|---|---|---|---|\n"
for run in $RUNS; do
  for prec in $PRECS; do
    out=$(mktemp -d)
    d=$(mt_run "$out" 1 "" $CFG $(mt_keys "$run") device=cuda precision=$prec steps=$((STEPS + 1)) log_every=$STEPS \
        progress=false ckpt_path=none val_batches=1)
    [ -n "$d" ] || echo "meshtrain $run $prec failed: $(mt_failed "$out" 3)" >&2
    tok=$(field tokens_per_s "$d") mem=$(field gpu_peak_alloc_bytes "$d") est=$(field estimate_bytes "$d")
    mfu=$(grep '"mfu"' "$out/log.jsonl" | tail -1 | grep -o '"mfu":[0-9.e+-]*' | cut -d: -f2)
    ptok="" pmem=""
    if [ "${PEER_RUN:-1}" = 1 ] && [ -f "$PEER" ]; then
      extra="compile=1"; [ "$prec" = mixed ] && extra="compile=1 amp=1"
      j=$(python3 "$PEER" $CFG $(peer_keys "$run") steps=$STEPS warmup=3 $extra 2>&1 | grep '^{' | tail -1)
      ptok=$(field tokens_per_s "$j") pmem=$(field peak_mem_gb "$j")
      [ -n "$ptok" ] || echo "peer $run $extra failed" >&2
    fi
    awk -v n="$run" -v p="$prec" -v t="${tok:-0}" -v m="${mem:-0}" -v e="${est:-0}" -v f="${mfu:-0}" -v pt="${ptok:-0}" \
        -v pm="${pmem:-0}" 'BEGIN{printf "| %s | %s | %.0f | %.1f | %.1f | %.1f%% | %s | %s | %s | %s |\n", n, p, t,
          m/1e9, e/1e9, 100*f, (pt > 0 ? sprintf("%.0f", pt) : "-"), (pm > 0 ? pm : "-"),
          (pt > 0 ? sprintf("%.2fx", t/pt) : "-"), (pm > 0 ? sprintf("%.2fx", m/1e9/pm) : "-")}'
    grep -o '"moe":{.*' "$out/log.jsonl" | tail -1 | cut -c1-300 >&2
    rm -rf "$out"
    if [ "$run" != dense ] && [ "$SKEW" != 0 ]; then
      out=$(mktemp -d)
      d=$(mt_run "$out" 1 "MESHTRAIN_MOE_SKEW=$SKEW" $CFG $(mt_keys "$run") device=cuda precision=$prec \
          steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1)
      stok=$(field tokens_per_s "$d")
      imb=$(grep -o '"imbalance":[0-9.]*' "$out/log.jsonl" | cut -d: -f2 | sort -g | tail -1)
      echo "  skewed router (MESHTRAIN_MOE_SKEW=$SKEW): ${stok:-failed} tokens/s, $(awk -v a="${stok:-0}" -v b="${tok:-1}" \
           'BEGIN{printf "%.2fx", a/b}') the balanced run's, largest max/mean load ${imb:--}"
      rm -rf "$out"
    fi
  done
done
