#!/usr/bin/env bash
# The post's configuration (embed_dim=1024 n_heads=8 n_layers=16 batch_size=128
# context_len=256) on one GPU: meshtrain and the PyTorch peer in the same call, on the
# same card. Usage: bench/gpu_post.sh [peer.py] [meshtrain keys...]
# (The peer is ../shared/peers/torch_llama.py; carry a copy when the call runs elsewhere.)
set -u
PEER=${1:-../shared/peers/torch_llama.py}; shift || true
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256"
BIN=${MESHTRAIN_BIN:-build/meshtrain}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
out=$(mktemp -d)
"$BIN" train $CFG device=cuda steps=8 progress=false out_dir="$out" "$@" | grep -E "^step|^done|memory per|total"
grep '"done"' "$out/log.jsonl"
for extra in "" "compile=1" "compile=1 amp=1"; do
  echo "peer $extra:"
  python3 "$PEER" $CFG steps=10 warmup=3 $extra 2>&1 | tail -1
done
