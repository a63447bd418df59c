#!/usr/bin/env bash
# The longest context the post's model (embed_dim=1024 n_heads=8 n_layers=16, pure bf16,
# batch_size=1) trains at with tensor parallel over NP GPUs, meshtrain
# (tp=NP, sequence parallel, activation checkpointing) beside the peer (torch_llama_tp.py,
# tp=NP, the post's plan; it has no activation checkpointing), in one run:
# - the peer at each context of PEER_CTXS, ascending, until one fails (out of memory): its
#   longest is the last that ran;
# - meshtrain at each context of MT_CTXS (2 steps, the second timed), with its peak and
#   estimate; and `meshtrain estimate` at the largest context whose estimate fits the card
#   (powers of two), which the memory allows but the call's time may not.
# The data: the 2 MiB TinyStories head repeated 8 times (1.9M tokens), its training shard
# also the validation shard (the windows at these contexts outgrow the bundled val.bin).
# Usage: NPS="2 4" MT_CTXS="131072 262144" PEER_CTXS="32768 65536 131072" bench/gpu_longest.sh [meshtrain] [peer.py]
set -u
BIN=${1:-build/meshtrain} PEER=${2:-../shared/peers/torch_llama_tp.py}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
DD=/tmp/longest-data
if [ ! -s $DD/train.bin ]; then
  for i in 1 2 3 4 5 6 7 8; do cat data/tinystories/TinyStories-train.head-2MiB.txt; done >/tmp/longest.txt
  "$BIN" prepare input=/tmp/longest.txt data_dir=$DD >/dev/null || { echo "prepare failed"; exit 1; }
fi
MODEL="embed_dim=1024 n_heads=8 n_layers=16"
cardgb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print $1 / 1024}')
for NP in ${NPS:-2 4}; do
  echo "== tp=$NP"
  last=""
  for T in ${PEER_CTXS:-32768 65536 131072}; do
    j=$(cd "$(dirname "$PEER")" && timeout "${PEER_TIMEOUT:-180}" torchrun --standalone --nproc_per_node="$NP" \
        "$(basename "$PEER")" $MODEL context_len=$T batch_size=1 tp=$NP warmup=1 steps=1 2>&1 | grep '^{' | tail -1)
    t=$(field tokens_per_s "$j")
    if [ -z "$t" ]; then echo "peer tp=$NP context $T: failed (out of memory or time)"; break; fi
    printf 'peer tp=%d context %7d: %9.0f tokens/s  peak %5.1f GB\n' "$NP" "$T" "$t" "$(field peak_mem_gb "$j")"
    last=$T
  done
  echo "peer tp=$NP longest: ${last:-none}"
  for T in ${MT_CTXS:-131072 262144}; do
    mt_row "meshtrain tp=$NP context $T" "$NP" $MODEL context_len=$T batch_size=1 tensor_parallel_size=$NP \
      activation_checkpointing=true device=cuda precision=bf16 data_dir=$DD val_data=$DD/train.bin val_batches=1 \
      steps=2 log_every=1 progress=false ckpt_path=none
  done
  fit=""
  for T in 131072 262144 524288 1048576 2097152; do
    g=$("$BIN" estimate $MODEL context_len=$T batch_size=1 tensor_parallel_size=$NP world_size=$NP \
        activation_checkpointing=true device=cuda precision=bf16 2>/dev/null | awk '/^  total/ {print $2, $3}')
    [ -n "$g" ] || break  # the estimate refused the context
    gib=$(awk -v v="${g% *}" -v u="${g#* }" 'BEGIN{print u == "TiB" ? v * 1024 : u == "GiB" ? v : v / 1024}')
    awk -v a="$gib" -v c="$cardgb" 'BEGIN{exit !(a < 0.95 * c)}' && fit="$T ($g)"
  done
  echo "meshtrain tp=$NP: the largest power-of-two context whose estimate fits ${cardgb} GiB: ${fit:-none}"
done
