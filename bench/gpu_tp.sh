#!/usr/bin/env bash
# Tensor parallel on the GPUs of one machine: meshtrain and the DTensor peer
# (../shared/peers/torch_llama_tp.py, the post's plan) in the same call, on the same cards.
#   long: the post's long-context run (context_len=10000 embed_dim=1024 n_heads=8
#         n_layers=16 batch_size=4, pure bf16): tp=NP for both, the peer's tp=1 (DDP over
#         NP, batch_size=4 per GPU) and meshtrain on one GPU, for reference
#   eff:  TP efficiency where TP is meant to pay (embed_dim=4096 n_heads=32 n_layers=8
#         context_len=4096 batch_size=1): per-GPU tokens/s at tp=NP against one GPU's
# Usage: NP=2 SECTIONS="long eff" [PEER_DDP=0] bench/gpu_tp.sh [meshtrain] [peer.py]
# TP (default NP): the long run's tensor-parallel size, NP / TP data-parallel (meshtrain: DDP
# over the rest; the peer's TP groups then train apart, without a gradient sum between them:
# torch_llama_tp.py wraps no data parallel around its tp mesh), e.g. NP=8 TP=4.
# STEPS timed steps (meshtrain runs one more and excludes it; the peer 2 warm-up steps).
# VARIANTS: meshtrain's tensor-parallel runs again under each of these environment settings
# (';' between variants, spaces between the variables of one; the first, default empty, is
# the plain run), e.g. VARIANTS=";NCCL_PROTO=Simple"; KEY_VARIANTS: the same with keys, e.g.
# KEY_VARIANTS=";tp_comm=collectives" (the default against the collectives).
set -u
BIN=${1:-build/meshtrain} PEER=${2:-../shared/peers/torch_llama_tp.py}
NP=${NP:-2} STEPS=${STEPS:-10}
export MT_TIMEOUT=${MT_TIMEOUT:-240}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NP"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
COMMON="device=cuda precision=bf16 progress=false ckpt_path=none val_batches=1 log_every=$STEPS steps=$((STEPS + 1))"

# mt NAME NPROC KEYS...: one meshtrain row (bench/lib.sh's mt_row, with COMMON)
mt() { local name=$1 np=$2; shift 2; mt_row "$name" "$np" $COMMON "$@"; }
# peer NAME NPROC KEYS...: one peer row
peer() {
  local name=$1 np=$2; shift 2
  local j; j=$(timeout "$MT_TIMEOUT" torchrun --standalone --nproc_per_node="$np" "$PEER" "$@" 2>&1 | grep '^{' | tail -1)
  local t; t=$(field tokens_per_s "$j")
  [ -n "$t" ] || { echo "$name: failed"; return; }
  printf '%-34s %9.0f tokens/s  peak %5.1f GB\n' "$name" "$t" "$(field peak_mem_gb "$j")"
}

IFS=';' read -r -a variants <<<"${VARIANTS:-}"; [ ${#variants[@]} -gt 0 ] || variants=("")
IFS=';' read -r -a kvs <<<"${KEY_VARIANTS:-}"; [ ${#kvs[@]} -gt 0 ] || kvs=("")
for s in ${SECTIONS:-long eff}; do
  case $s in
  long)
    LONG="context_len=10000 embed_dim=1024 n_heads=8 n_layers=16"
    TP=${TP:-$NP}
    echo "== long context: $LONG batch_size=4, tp=$TP on $NP GPUs"
    for v in "${variants[@]}"; do for k in "${kvs[@]}"; do
      MT_ENV=$v mt "meshtrain tp=$TP${v:+ ($v)}${k:+ $k}" "$NP" $LONG batch_size=4 tensor_parallel_size=$TP $k
    done; done
    peer "peer tp=$TP" "$NP" $LONG batch_size=4 tp=$TP steps=$STEPS
    mt "meshtrain 1 GPU" 1 $LONG batch_size=4
    [ "${PEER_DDP:-1}" = 1 ] && peer "peer tp=1 (DDP over $NP)" "$NP" $LONG batch_size=4 tp=1 steps=$STEPS
    ;;
  eff)
    EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1"
    echo "== TP efficiency: $EFF (per-GPU tokens/s = tokens/s / GPUs)"
    mt "meshtrain 1 GPU" 1 $EFF
    for v in "${variants[@]}"; do for k in "${kvs[@]}"; do
      MT_ENV=$v mt "meshtrain tp=$NP${v:+ ($v)}${k:+ $k}" "$NP" $EFF tensor_parallel_size=$NP $k
    done; done
    peer "peer tp=$NP" "$NP" $EFF tp=$NP steps=$STEPS
    ;;
  esac
done
