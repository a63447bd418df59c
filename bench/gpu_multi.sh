#!/usr/bin/env bash
# Several GPUs of one machine, meshtrain and the PyTorch peer (torchrun) in the same call:
# - data parallel at the post's configuration per GPU (embed_dim=1024 n_heads=8
#   n_layers=16 batch_size=128 context_len=256): meshtrain on one GPU, then DDP, ZeRO-1 and
#   ZeRO-2 on NP GPUs (tokens/s, scaling against one GPU, peak memory per GPU and the
#   estimate), beside `torchrun --nproc_per_node=NP torch_llama.py compile=1` (pure bf16)
#   and `compile=1 amp=1`;
# - with BIG=1 (NP=2): FSDP of the post's 7.26B model (embed_dim=4096 n_heads=32
#   n_layers=48 context_len=256) at batch_size 1 and 8 per GPU, beside
#   `torchrun ... torch_llama.py fsdp=1`.
# Usage: NP=2 BIG=1 bench/gpu_multi.sh [peer.py]
# RUNS picks meshtrain's rows ("1:bf16 ddp:bf16 zero1:bf16 zero2:bf16 1:mixed ddp:mixed");
# PEER_RUNS the peer's ("compile amp"). FSDP_KEYS_B1 / FSDP_KEYS_B8: extra meshtrain keys
# for the 7B runs (default: activation_checkpointing=true at batch 1).
set -u
PEER=${1:-../shared/peers/torch_llama.py}
NP=${NP:-2}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256"
. "$(dirname "$0")/lib.sh"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $NP x $card"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null

gb() { awk -v b="${1:-0}" 'BEGIN{printf "%.1f", b/1e9}'; }
rows=()
mt() {  # mt LABEL NPROC KEYS...: one meshtrain run, a row of the table
  local label=$1 np=$2; shift 2
  local out d; out=$(mktemp -d)
  d=$(mt_run "$out" "$np" "" "$@" device=cuda steps=10 log_every=5 progress=false ckpt_path=none)
  grep -E "^done|communication" "$out/stdout" | sed "s/^/  [$label] /" >&2
  [ -n "$d" ] || { echo "  [$label] failed: $(mt_failed "$out" 3)" >&2; }
  rows+=("$label|$(field tokens_per_s "$d")|$(gb "$(field gpu_peak_alloc_bytes "$d")")|$(gb "$(field estimate_bytes "$d")")")
}
peer() {  # peer LABEL NPROC KEYS...
  local label=$1 np=$2; shift 2
  local j; j=$(peer_run "$np" "$@" steps=10 warmup=3)
  [ -n "$j" ] || echo "  [$label] failed" >&2
  rows+=("$label|$(field tokens_per_s "$j")|$(field peak_mem_gb "$j")|")
}

for r in ${RUNS:-1:bf16 ddp:bf16 zero1:bf16 zero2:bf16 1:mixed ddp:mixed}; do
  s=${r%%:*}; prec=${r#*:}
  case $s in
    1) mt "meshtrain $prec, 1 GPU" 1 $CFG precision=$prec ;;
    ddp) mt "meshtrain $prec, DDP $NP GPUs" "$NP" $CFG precision=$prec ;;
    zero1) mt "meshtrain $prec, ZeRO-1 $NP GPUs" "$NP" $CFG precision=$prec zero_opt=true ;;
    zero2) mt "meshtrain $prec, ZeRO-2 $NP GPUs" "$NP" $CFG precision=$prec fsdp=true shard_strategy=grad_op ;;
  esac
done
for p in ${PEER_RUNS:-compile amp}; do
  case $p in
    compile) peer "peer torchrun compile=1, $NP GPUs" "$NP" $CFG compile=1 ;;
    amp) peer "peer torchrun compile=1 amp=1, $NP GPUs" "$NP" $CFG compile=1 amp=1 ;;
  esac
done
if [ "${BIG:-0}" = 1 ]; then
  BIGCFG="embed_dim=4096 n_heads=32 n_layers=48 context_len=256"
  mt "meshtrain bf16 FSDP 7.26B, batch 1" "$NP" $BIGCFG batch_size=1 precision=bf16 fsdp=true \
    ${FSDP_KEYS_B1:-activation_checkpointing=true}
  mt "meshtrain bf16 FSDP 7.26B, batch 8" "$NP" $BIGCFG batch_size=8 precision=bf16 fsdp=true ${FSDP_KEYS_B8:-}
  peer "peer torchrun fsdp=1 7.26B, batch 1" "$NP" $BIGCFG batch_size=1 fsdp=1
  peer "peer torchrun fsdp=1 7.26B, batch 8" "$NP" $BIGCFG batch_size=8 fsdp=1
fi

printf "\n| run (%s x %s) | tokens/s | peak GB per GPU | estimate GB |\n|---|---|---|---|\n" "$NP" "$card"
for r in "${rows[@]}"; do
  IFS='|' read -r n t m e <<<"$r"
  printf "| %s | %.0f | %s | %s |\n" "$n" "${t:-0}" "${m:--}" "${e:--}"
done
