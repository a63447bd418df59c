#!/usr/bin/env bash
# Builds side by side: whole training steps on one GPU: the post's model (bf16) at each context x batch in
# CONTEXTS, each variant in VARIANTS run in turn, ROUNDS rounds, so that binaries or knobs are
# compared in one run on one card. A variant is NAME:BINARY[:SETTING[,SETTING...]], a setting
# being an environment variable (VAR=value, VAR in capitals) or a key (key=value).
# Prints one row a run (tokens/s, the GPU allocator's peak, the estimate), then the medians.
# MODEL replaces the post's shape (default "embed_dim=1024 n_heads=8 n_layers=16"), e.g.
# "embed_dim=768 n_heads=8 n_layers=16" for head_dim 96.
# Usage: ROUNDS=2 CONTEXTS="1024:32 4096:8" \
#   VARIANTS="old:build-old/meshtrain new:build/meshtrain fast:build/meshtrain:deterministic=false" bench/step_ab.sh
set -u
. "$(dirname "$0")/lib.sh"
STEPS=${STEPS:-20}
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
res=$(mktemp)
for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
  for ct in ${CONTEXTS:-1024:32 4096:8}; do
    T=${ct%%:*} B=${ct##*:}
    for v in ${VARIANTS:?NAME:BINARY[:SETTINGS] ...}; do
      name=${v%%:*} rest=${v#*:}; BIN=${rest%%:*} envs="" keys=""
      settings=""; [ "$rest" != "$BIN" ] && settings=${rest#*:}
      for kv in ${settings//,/ }; do
        if [[ $kv =~ ^[A-Z] ]]; then envs="$envs $kv"; else keys="$keys $kv"; fi
      done
      [ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
      out=$(mktemp -d)
      d=$(mt_run "$out" 1 "$envs" ${MODEL:-embed_dim=1024 n_heads=8 n_layers=16} context_len=$T batch_size=$B device=cuda \
            precision=${PREC:-bf16} steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1 $keys)
      [ -n "$d" ] || { echo "T=$T B=$B $name: failed: $(mt_failed "$out")"; continue; }
      t=$(field tokens_per_s "$d")
      printf 'round %d  T=%-6s B=%-4s %-12s %9.0f tokens/s  peak %s GiB  estimate %s GiB\n' "$r" "$T" "$B" "$name" "$t" \
        "$(gib "$(field gpu_peak_alloc_bytes "$d")" 2)" "$(gib "$(field estimate_bytes "$d")" 2)"
      echo "T=${T}_B=$B $name $t" >>"$res"
    done
  done
done
echo "medians:"
awk '{print $1, $2}' "$res" | awk '!s[$0]++' | while read -r k n; do
  printf '  %-16s %-12s %9.0f tokens/s\n' "${k//_/ }" "$n" "$(awk -v k="$k" -v n="$n" '$1 == k && $2 == n {print $3}' "$res" | median)"
done
rm -f "$res"
