#!/usr/bin/env bash
# The TP-efficiency rows alone (no peer): one GPU and tp=NP, each under every variant of
# VARIANTS (environment settings: ';' between, spaces between one's variables; the first,
# default empty, the plain run) and, for tp=NP, of KEY_VARIANTS (keys, alike: e.g.
# ";tp_comm=collectives", the default against the collectives), STEPS timed steps, REPS rounds
# alternating; bench/gpu_tp.sh runs the table with the peer.
# TP_KEYS: more keys for every tp run (e.g. sequence_parallel=false).
# Usage: NP=2 [VARIANTS=...] [KEY_VARIANTS=";tp_comm=collectives"] [ONE_VARIANTS=...] [TP_KEYS=...] bench/tp_eff_rows.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} NP=${NP:-2} STEPS=${STEPS:-20}
export MT_TIMEOUT=${MT_TIMEOUT:-240}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1 device=cuda precision=bf16 progress=false ckpt_path=none val_batches=1 log_every=$STEPS steps=$((STEPS + 1))"
IFS=';' read -r -a variants <<<"${VARIANTS:-}"; [ ${#variants[@]} -gt 0 ] || variants=("")
IFS=';' read -r -a ones <<<"${ONE_VARIANTS:-}"; [ ${#ones[@]} -gt 0 ] || ones=("")
IFS=';' read -r -a kvs <<<"${KEY_VARIANTS:-}"; [ ${#kvs[@]} -gt 0 ] || kvs=("")
for ((r = 1; r <= ${REPS:-1}; r++)); do
  for v in "${ones[@]}"; do MT_ENV=$v mt_row "1 GPU${v:+ ($v)}" 1 $EFF; done
  for v in "${variants[@]}"; do
    for k in "${kvs[@]}"; do
      MT_ENV=$v mt_row "tp=$NP${v:+ ($v)}${k:+ $k}${TP_KEYS:+ $TP_KEYS}" "$NP" $EFF tensor_parallel_size=$NP ${TP_KEYS:-} $k
    done
  done
done
