#!/usr/bin/env bash
# Pipeline schedules at pp=NP m=M with NCCL's send/receive kernels capped to CTAS CTAs
# (NCCL_MAX_CTAS; a p2p kernel waiting for its peer keeps its SMs from compute), against one
# GPU at the micro-batch size. Usage: NP=4 M=8 CAPS="1 2" bench/pp_ctas.sh
set -u
NP=${NP:-4} M=${M:-8} STEPS=${STEPS:-20} CAPS=${CAPS:-1 2} SCHEDS=${SCHEDS:-1f1b zb1 interleaved gpipe}
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain}
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=bf16"
RUN="steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
out=$(mktemp -d)
one=$(field tokens_per_s "$(mt_run "$out" 1 "" $POST batch_size=$((128 / M)) $RUN)")
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP; one GPU at batch $((128 / M)): $one"
for cap in $CAPS; do
  for sched in $SCHEDS; do
    out=$(mktemp -d)
    t=$(field tokens_per_s "$(mt_run "$out" "$NP" "NCCL_MAX_CTAS=$cap" $POST batch_size=128 pipeline_parallel_size=$NP \
        micro_batches=$M pipeline_schedule=$sched $RUN)")
    echo "NCCL_MAX_CTAS=$cap $sched m=$M: $t tokens/s ($(awk -v t="$t" -v o="$one" -v p="$NP" 'BEGIN{printf "%.3f", t / (p * o)}') of NP x one GPU)"
  done
done
