#!/usr/bin/env bash
# Pipeline parallel on NP GPUs of one machine, the post's model in pure bf16
# (batch 128 at context 256), in one call: for each m in MS, one GPU at the micro-batch size
# B/m, then meshtrain with each schedule in SCHEDS, each beside the bubble's prediction from
# that one-GPU speed:
#   gpipe, 1f1b:  NP x one x m / (m + NP - 1)
#   interleaved:  NP x one x m / (m + (NP - 1) / v)      (v = VS virtual stages per rank)
#   zb1:          NP x one x 3m / (3m + NP - 1)          (ZB-H1 with F = B = W)
# and the measured bubble (1 - tokens/s / (NP x one)) beside the predicted one; then the
# peer (torch.distributed.pipelining, PEER_SCHEDS at m in PEER_MS, PEER_COMPILE=1 compiles
# each block; the zbv schedule always eager: compiled it gives no result) at the same layout. PP_CE="0 1": each schedule with send/receive on NCCL's
# kernels (0: pp_copy_engines=false) and on the copy engines (1: pp_copy_engines=true; the row says which
# path the header reports); default "1" (the default path). GRAPHS=false|true: the key
# cuda_graphs on every run, the one-GPU reference included (unset: each run's default, on for
# one process, off for several).
# Usage: NP=4 MS="8 32" SCHEDS="gpipe 1f1b interleaved zb1" PP_CE="0 1" PEER_SCHEDS="1f1b interleaved zbv" \
#        PEER_MS=8 bench/gpu_pipeline.sh [PEER_DIR]   (PEER_DIR holds torch_llama_pp.py)
set -u
NP=${NP:-2} MS=${MS:-8} STEPS=${STEPS:-20} VS=${VS:-2} PP_CE=${PP_CE:-1}
SCHEDS=${SCHEDS:-gpipe 1f1b interleaved zb1}
PEER_SCHEDS=${PEER_SCHEDS:-1f1b} PEER_MS=${PEER_MS:-8} PEER_COMPILE=${PEER_COMPILE:-1}
PEERS=${1:-../shared/peers}
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain}
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=bf16"
RUN="steps=$((STEPS + 1)) log_every=$STEPS progress=false ckpt_path=none val_batches=1"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
row() { printf '| %s | %s | %s | %s | %s |\n' "$@"; }
gb() { grep -o "\"$1\":[0-9]*" "$2" | cut -d: -f2 | awk '{printf "%.1f", $1/1e9}'; }
echo "| run | tokens/s | of prediction | bubble measured / predicted | peak GB (rank 0) |"
echo "|---|---|---|---|---|"
for M in $MS; do
  out=$(mktemp -d)
  d=$(mt_run "$out" 1 "" $POST batch_size=$((128 / M)) $RUN ${GRAPHS:+cuda_graphs=$GRAPHS})
  one=$(field tokens_per_s "$d"); [ -n "$one" ] || { echo "one GPU failed: $(mt_failed "$out")"; continue; }
  row "one GPU, batch $((128 / M))" "$one" "-" "-" "$(gb gpu_peak_alloc_bytes "$out/log.jsonl")"
  for sched in $SCHEDS; do
    case $sched in
      interleaved) keys="virtual_stages=$VS"; frac=$(awk -v m="$M" -v p="$NP" -v v="$VS" 'BEGIN{print m / (m + (p - 1) / v)}') ;;
      zb1) keys=""; frac=$(awk -v m="$M" -v p="$NP" 'BEGIN{print 3 * m / (3 * m + p - 1)}') ;;
      *) keys=""; frac=$(awk -v m="$M" -v p="$NP" 'BEGIN{print m / (m + p - 1)}') ;;
    esac
    pred=$(awk -v o="$one" -v p="$NP" -v f="$frac" 'BEGIN{printf "%.0f", p * o * f}')
    for ce in $PP_CE; do
      out=$(mktemp -d)
      d=$(mt_run "$out" "$NP" "" $POST batch_size=128 pipeline_parallel_size=$NP micro_batches=$M \
          pipeline_schedule=$sched $keys pp_copy_engines=$([ "$ce" = 1 ] && echo true || echo false) $RUN \
          ${GRAPHS:+cuda_graphs=$GRAPHS})
      t=$(field tokens_per_s "$d")
      [ -n "$t" ] || { echo "pp $sched m=$M PP_CE=$ce failed: $(mt_failed "$out" 4)"; continue; }
      path=NCCL  # with PP_CE=1, the path the header reports ("copy engines", or NCCL's where it cannot)
      [ "$ce" = 0 ] || path=$(sed -n 's/^pipeline send\/receive: \([^(]*[^ (]\) *(.*/\1/p' "$out/stdout" | head -1)
      row "meshtrain pp=$NP $sched${keys:+ ($keys)} m=$M PP_CE=$ce ($path)" "$t" \
        "$(awk -v t="$t" -v p="$pred" 'BEGIN{printf "%.3f (%s)", t / p, p}')" \
        "$(awk -v t="$t" -v o="$one" -v p="$NP" -v f="$frac" 'BEGIN{printf "%.1f%% / %.1f%%", 100 * (1 - t / (p * o)), 100 * (1 - f)}')" \
        "$(gb gpu_peak_alloc_bytes "$out/log.jsonl")"
      grep "^pipeline stage" "$out/stdout" | sed 's/^/    /'
    done
  done
done
if [ -f "$PEERS/torch_llama_pp.py" ]; then
  for M in $PEER_MS; do
    for sched in $PEER_SCHEDS; do
      pc=$PEER_COMPILE; [ "$sched" = zbv ] && pc=0  # (the peer's zbv gives no result compiled, 2026-11-28)
      p=$(cd "$PEERS" && timeout 150 torchrun --standalone --nproc_per_node="$NP" torch_llama_pp.py embed_dim=1024 \
          n_heads=8 n_layers=16 batch_size=128 context_len=256 micro_batches=$M schedule=$sched compile=$pc \
          steps=$STEPS 2>&1 | grep '^{' | tail -1)
      row "peer pp=$NP $sched m=$M (compile=$pc)" "$(field tokens_per_s "$p")" "-" "-" \
        "$(grep -o '"peak[a-z_]*": *[0-9.]*' <<<"$p" | head -1)"
    done
  done
fi
