#!/usr/bin/env bash
# Layouts and gradient compression across slow links (CPU ranks on emulated hosts,
# scripts/cluster.sh, as root). For each link rate: 2 hosts x 1 rank with DDP (uncompressed,
# int8, PowerSGD rank 1) and FSDP (uncompressed, int8); then 2 hosts x 2 ranks with DDP flat,
# machine by machine, machine by machine with int8 across, and hybrid FSDP (uncompressed, int8 on
# the replicas' all-reduce across). Prints one markdown table: tokens/s,
# the bytes rank 0 sent a step (the log's comm_bytes, the mean over the steps) beside the bytes
# its host's link carried a step (tc's counter, all the host's ranks, validation included), the final validation loss, and the wall time until the
# validation loss first reached the uncompressed DDP run's final one (validation every 10 steps).
# With one rank a host, the last column compares the whole run's bytes: what host 0's link sent
# (frames: TCP/IP and Ethernet headers, the acknowledgements of what it received) over what rank 0
# gave MPI to send (the log's comm_bytes_total: set-up, steps, validation).
#   bash bench/cluster_compression.sh [RATES...]     (default: 1gbit 100mbit)
# Env: STEPS (40); ONLY=TEXT runs only the layouts whose label holds TEXT (e.g. ONLY=2x1).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(pwd)/${MESHTRAIN_BIN:-build/meshtrain}
rates=("$@"); [ ${#rates[@]} -gt 0 ] || rates=(1gbit 100mbit)
STEPS=${STEPS:-40}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
name=cc$$
name=${name:0:12}
trap 'scripts/cluster.sh down "$name" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
head -c 1000000 data/tinystories/TinyStories-train.head-2MiB.txt > "$tmp/stories.txt"
"$BIN" prepare input="$tmp/stories.txt" data_dir="$tmp/data" >/dev/null
# the tests' tiny model (1.63M parameters, 6.5 MB of fp32 gradient), the global batch 8
KEYS="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 tie_embeddings=true steps=$STEPS lr=3e-3
      warmup_steps=5 progress=false threads=1 val_every=10 val_batches=4 ckpt_path=none data_dir=$tmp/data"
sent() { tc -s -n "mt-$name-h0" qdisc show dev eth0 | awk '/Sent/ {print $2; exit}'; }
# report LABEL LOG LINK_BYTES TARGET: a table row from a run's log
report() {
  python3 - "$1" "$2" "$3" "$4" "$STEPS" <<'EOF'
import json, sys
label, log, link, target, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rows = [json.loads(l) for l in open(log)]
st = [r for r in rows if "step" in r and "loss" in r]
val = [r for r in rows if "val_loss" in r and "step" in r]
tok = sum(r["tokens_per_s"] for r in st[1:]) / len(st[1:])
total = next((r["comm_bytes_total"] for r in rows if r.get("done") and "comm_bytes_total" in r), 0)
whole = f"{link / total:.4f}" if total and "x1" in label else "-"
cb = sum(r.get("comm_bytes", 0) for r in st) / len(st)
t, reach = 0.0, None
ms = {r["step"]: r["ms"] for r in st}
for v in val:
    if reach is None and target != "-" and v["val_loss"] <= float(target) + 1e-9:
        reach = sum(ms[s] for s in ms if s <= v["step"]) / 1e3
print(f'| {label} | {tok:,.0f} | {cb / 1e6:.3f} | {link / steps / 1e6:.3f} | {val[-1]["val_loss"]:.4f} | '
      f'{"not reached" if reach is None else f"{reach:.1f} s"} | {whole} |')
EOF
}
run() {  # run LABEL PER_HOST NP KEYS...
  local label=$1 per=$2 np=$3; shift 3
  [ -z "${ONLY:-}" ] || [[ $label == *"$ONLY"* ]] || return 0
  local out=$tmp/$RANDOM$RANDOM b0 b1
  b0=$(sent)
  scripts/cluster.sh run "$name" --per-host "$per" -- --oversubscribe --bind-to none -np "$np" "$BIN" train $KEYS "$@" \
    out_dir="$out" >"$out.log" 2>&1 || { echo "| $label | failed: $(grep -m1 meshtrain: "$out.log") |"; return; }
  b1=$(sent)
  [ "$label" = "DDP 2x1" ] && target=$(grep -o '"val_loss":[0-9.]*' "$out/log.jsonl" | tail -1 | cut -d: -f2)
  report "$label" "$out/log.jsonl" $((b1 - b0)) "${target:--}"
}
echo "| layout | tokens/s | MB sent a step (rank 0) | MB on its host's link a step | final val_loss | time to DDP's val_loss | link / counted, whole run |"
echo "|---|---|---|---|---|---|---|"
for r in "${rates[@]}"; do
  line=$(scripts/cluster.sh up "$name" --hosts 2 --rate "$r")
  echo "| **$r**, measured $(sed -n 's/.*measured=\([^ ]*\).*/\1/p' <<<"$line") | | | | | | |"
  target=-
  run "DDP 2x1" 1 2 batch_size=4
  run "DDP 2x1, int8" 1 2 batch_size=4 grad_compression=int8
  run "DDP 2x1, PowerSGD rank 1" 1 2 batch_size=4 grad_compression=powersgd powersgd_warmup=5
  run "FSDP 2x1" 1 2 batch_size=4 fsdp=true
  run "FSDP 2x1, int8" 1 2 batch_size=4 fsdp=true grad_compression=int8
  run "DDP 2x2, flat" 2 4 batch_size=2 dp_allreduce=flat
  run "DDP 2x2, machine by machine" 2 4 batch_size=2 dp_allreduce=hierarchical
  run "DDP 2x2, machine by machine, int8 across" 2 4 batch_size=2 dp_allreduce=hierarchical grad_compression=int8
  run "hybrid FSDP 2x2 (shards inside a host)" 2 4 batch_size=2 fsdp=true shard_strategy=hybrid
  run "hybrid FSDP 2x2, int8 across" 2 4 batch_size=2 fsdp=true shard_strategy=hybrid grad_compression=int8
  scripts/cluster.sh down "$name" >/dev/null
done
