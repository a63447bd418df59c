#!/usr/bin/env bash
# What a slow link between hosts costs a data-parallel run: 2 emulated hosts x 1 CPU rank
# (scripts/cluster.sh, as root) at each link rate, and the same 2 ranks on one host, on the
# same machine in one sitting. Prints a markdown table: the link's rate, the bandwidth
# measured across it, tokens/s and the step's mean ms.
#   bash bench/cluster_links.sh [RATES...]      (default: 10gbit 1gbit 100mbit)
# Env: MODEL (the keys of the model and batch; default the tests' tiny model), STEPS (20).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MESHTRAIN_BIN:-build/meshtrain}
rates=("$@"); [ ${#rates[@]} -gt 0 ] || rates=(10gbit 1gbit 100mbit)
STEPS=${STEPS:-20}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
name=bench$$
name=${name:0:12}
trap 'scripts/cluster.sh down "$name" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
head -c 400000 data/tinystories/TinyStories-train.head-2MiB.txt > "$tmp/stories.txt"
"$BIN" prepare input="$tmp/stories.txt" data_dir="$tmp/data" >/dev/null
MODEL=${MODEL:-"vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 tie_embeddings=true batch_size=4"}
KEYS="$MODEL steps=$STEPS lr=1e-3 progress=false threads=1 val_every=0 ckpt_path=none data_dir=$tmp/data"
# tokens/s and the mean step ms after the first step, from a run's log
speed() {
  python3 - "$1" <<'EOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and '"loss"' in l][1:]
ms = sum(s["ms"] for s in steps) / len(steps)
print(f'{sum(s["tokens_per_s"] for s in steps) / len(steps):,.0f} | {ms:.1f}')
EOF
}
echo "| link | measured | tokens/s | ms/step |"
echo "|---|---|---|---|"
mpirun --oversubscribe --bind-to none -np 2 "$BIN" train $KEYS out_dir="$tmp/one" >/dev/null 2>&1
echo "| one host (shared memory) | - | $(speed "$tmp/one/log.jsonl") |"
for r in "${rates[@]}"; do
  line=$(scripts/cluster.sh up "$name" --hosts 2 --rate "$r")
  measured=$(sed -n 's/.*measured=\([^ ]*\).*/\1/p' <<<"$line")
  scripts/cluster.sh run "$name" -- -np 2 "$(pwd)/$BIN" train $KEYS out_dir="$tmp/$r" >/dev/null 2>&1
  echo "| $r | $measured | $(speed "$tmp/$r/log.jsonl") |"
  scripts/cluster.sh down "$name" >/dev/null
done
