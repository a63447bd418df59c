#!/usr/bin/env bash
# A knob's values compared under pipeline and tensor parallel, e.g. MESHTRAIN_PP_RECV (host or
# device). In one call, rounds alternating KNOB's VALUES (a value holding "=" is a
# comma-separated list of VAR=value instead, e.g. "MESHTRAIN_PP_CE=0,CUDA_DEVICE_MAX_CONNECTIONS=32"):
#   pp:  the post's model in pure bf16 (batch 128, context 256), pp=NP, m=M, each schedule in
#        SCHEDS, beside the bubble's prediction from one GPU at batch 128/M (all SMs)
#   tp:  TP efficiency's model (embed_dim=4096 n_heads=32 n_layers=8 context_len=4096
#        batch_size=1) at tp=2 (GPUs 0,1) and tp=NP, per-GPU tokens/s of one GPU's
# Usage: KNOB=MESHTRAIN_PP_RECV VALUES="host device" NP=4 SCHEDS="1f1b interleaved" ROUNDS=2 \
#        SECTIONS="pp tp" bench/knob_ab.sh
set -u
NP=${NP:-4} M=${M:-8} KNOB=${KNOB:-MESHTRAIN_PP_RECV} VALUES=${VALUES:-host device} SCHEDS=${SCHEDS:-1f1b interleaved} ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-20}
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain}
export MT_TIMEOUT=${MT_TIMEOUT:-180}
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
RUN="steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1 device=cuda precision=bf16"
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 batch_size=128"
EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1"
# envs VALUE: the variables a value sets (KNOB=VALUE, or VALUE's own list)
envs() { case $1 in *=*) echo "${1//,/ }" ;; *) echo "$KNOB=$1" ;; esac; }
# one NAME NPROC ENVS KEYS...: tokens/s of one run (and its name), or "failed: why"
one() {
  local name=$1 np=$2 envs=$3; shift 3
  local out d; out=$(mktemp -d)
  d=$(mt_run "$out" "$np" "$envs" $RUN "$@")
  if [ -n "$d" ]; then
    printf '%-72s %10.0f tokens/s  peak %5.1f GB\n' "$name" "$(field tokens_per_s "$d")" \
      "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')"
  else
    echo "$name: failed: $(mt_failed "$out" 3)"
  fi
}
for s in ${SECTIONS:-pp tp}; do
  case $s in
  pp)
    echo "== pp=$NP m=$M, the post's model"
    one "one GPU, batch $((128 / M))" 1 "" embed_dim=1024 n_heads=8 n_layers=16 context_len=256 batch_size=$((128 / M))
    for r in $(seq "$ROUNDS"); do
      for sched in $SCHEDS; do
        keys=""; [ "$sched" = interleaved ] && keys="virtual_stages=2"
        for v in $VALUES; do
          one "r$r $sched $(envs "$v")" "$NP" "$(envs "$v")" $POST pipeline_parallel_size=$NP micro_batches=$M \
            pipeline_schedule=$sched $keys
        done
      done
    done
    ;;
  tp)
    echo "== TP efficiency: $EFF (per GPU: tokens/s / tp)"
    one "one GPU" 1 "" $EFF
    for r in $(seq "$ROUNDS"); do
      for t in 2 $NP; do
        [ "$t" -le "$NP" ] || continue
        for v in $VALUES; do
          CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((t - 1))) one "r$r tp=$t $(envs "$v")" "$t" "$(envs "$v")" $EFF \
            tensor_parallel_size=$t
        done
      done
    done
    ;;
  esac
done
