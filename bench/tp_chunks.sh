#!/usr/bin/env bash
# Async tensor parallel (issue 19): each tensor-parallel collective split into
# MESHTRAIN_TP_CHUNKS chunks of rows beside its matrix product (src/model/layer_tp.c). On the
# TP-efficiency config (embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1,
# pure bf16): one GPU, then tp=NP with sequence parallel on and off for each count in
# CHUNKS; one row each with per-GPU tokens/s (tokens/s / NP) as a share of one GPU's, and
# the chunking the run reports (a count the rows do not divide falls back). First, unless
# CHECK=0: tp=NP with 4 chunks in fp32 follows one GPU (tiny model, sequence parallel on
# and off; ckpt_diff's max_rel_diff, which the CPU tests hold under 1e-5).
# Usage: NP=2 CHUNKS="1 2 4" [STEPS=10] [CHECK=1] bench/tp_chunks.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} NP=${NP:-2} STEPS=${STEPS:-10} CHUNKS=${CHUNKS:-1 2 4}
export MT_TIMEOUT=${MT_TIMEOUT:-180}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
DIFF=$(dirname "$BIN")/tests/ckpt_diff

if [ "${CHECK:-1}" = 1 ]; then
  M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 batch_size=8 steps=5 device=cuda precision=fp32 lr=1e-3 grad_clip=1 progress=false"
  o=$(mktemp -d)
  mkdir -p "$o/one" "$o/tp_true" "$o/tp_false"
  mt_run "$o/one" 1 "" $M >/dev/null
  for sp in true false; do
    mt_run "$o/tp_$sp" "$NP" "MESHTRAIN_TP_CHUNKS=4" $M tensor_parallel_size=$NP sequence_parallel=$sp >/dev/null
    echo "check: tp=$NP chunks=4 sequence_parallel=$sp fp32 vs one GPU: $("$DIFF" "$o/one/ckpt.bin" "$o/tp_$sp/ckpt.bin" 2>&1 | tr '\n' ' ')"
  done
  rm -rf "$o"
fi

C="device=cuda precision=bf16 progress=false ckpt_path=none val_batches=1 log_every=$STEPS steps=$((STEPS + 1))"
EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1"
echo "== TP efficiency: $EFF, pure bf16, $STEPS timed steps (per GPU: tokens/s / $NP)"
# row NAME NPROC ENVS KEYS...: one run; prints its row and sets TOK (its tokens/s, empty if it failed)
row() {
  local name=$1 np=$2 envs=$3; shift 3
  local out d; out=$(mktemp -d)
  d=$(mt_run "$out" "$np" "$envs" $C "$@")
  TOK=
  if [ -z "$d" ]; then echo "$name: failed: $(mt_failed "$out" 3)"; rm -rf "$out"; return; fi
  TOK=$(field tokens_per_s "$d")
  local per eff chunks loss
  per=$(awk -v t="$TOK" -v n="$np" 'BEGIN{printf "%.0f", t / n}')
  eff=$(awk -v p="$per" -v o="${ONE:-0}" 'BEGIN{if (o > 0) printf "%5.1f%%", 100 * p / o; else printf "    -"}')
  chunks=$(grep -o 'each collective in [0-9]* chunks\{0,1\} of [0-9]* rows' "$out/stdout" | head -1 | sed 's/each collective in //')
  loss=$(grep -o '"step":[0-9]*,"loss":[0-9.]*' "$out/log.jsonl" | tail -1 | sed 's/.*"loss"://')
  printf '%-40s %8.0f tokens/s  %7s per GPU  %s of one GPU  peak %5.1f GB  loss %s  %s\n' "$name" "$TOK" "$per" "$eff" \
    "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')" "$loss" "${chunks:+($chunks)}"
  rm -rf "$out"
}
ONE=
row "one GPU" 1 "" $EFF
ONE=$TOK
for sp in true false; do
  for c in $CHUNKS; do
    row "tp=$NP sequence_parallel=$sp chunks=$c" "$NP" "MESHTRAIN_TP_CHUNKS=$c" $EFF tensor_parallel_size=$NP \
      sequence_parallel=$sp
  done
done
