#!/usr/bin/env bash
# shellcheck disable=SC2086  # the key lists ($T, $M, $TR) are meant to split into words
# The CPU checks of bench/peers (README.md there lists their results): at a tiny size, in
# fp32 with gloo, each program's loss at step 1 and at its last step against the reference
# program's (run by run_ref.py) or against the one-process run with the same global batch.
# A few minutes on two cores; no GPU needed.
# Usage: bench/peers/check_cpu.sh [REF_DIR]   (REF_DIR holds the reference programs; default ../shared/peers)
set -euo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
here=$(cd "$(dirname "$0")" && pwd)
REF=${1:-$here/../../../shared/peers}
[ -f "$REF/torch_llama.py" ] || { echo "check_cpu: $REF/torch_llama.py: not found" >&2; exit 1; }
T="embed_dim=64 n_heads=4 n_layers=2 batch_size=4 context_len=32 vocab=512 steps=3 warmup=2 device=cpu"
T4="${T/n_layers=2/n_layers=4}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# row NAME CMD...: runs CMD, prints NAME with the summary's loss_step1 and loss
row() {
  local name=$1; shift
  if ! timeout 300 "$@" >"$log" 2>&1; then
    echo "$name: failed"; tail -5 "$log" | sed 's/^/    /'; return
  fi
  grep -q '^{"cfg"' "$log" || { echo "$name: no summary line"; tail -5 "$log" | sed 's/^/    /'; return; }
  grep '^{"cfg"' "$log" | tail -1 | python3 -c '
import json, sys; d = json.loads(sys.stdin.read())
print("%-44s step 1 %-20r last %r" % (sys.argv[1], d.get("loss_step1"), d["loss"]))' "$name"
}
# curve NAME FIELD CMD...: the per-step FIELD of a log_every=1 run, on one line
curve() {
  local name=$1 field=$2; shift 2
  timeout 300 "$@" log_every=1 >"$log" 2>&1 || { echo "$name: failed"; tail -5 "$log" | sed 's/^/    /'; return; }
  printf '%-44s %s\n' "$name" "$(grep '^{"step"' "$log" | python3 -c '
import json, sys; print(" ".join(repr(json.loads(l)[sys.argv[1]]) for l in sys.stdin))' "$field")"
}
TR="torchrun --standalone --nproc_per_node"
P=$here

echo "== one process (steps 1 and 5)"
row "ours" python3 "$P/train.py" $T
row "reference" python3 "$P/run_ref.py" "$REF/torch_llama.py" $T
row "ours ckpt=1" python3 "$P/train.py" $T ckpt=1
row "reference ckpt=1" python3 "$P/run_ref.py" "$REF/torch_llama.py" $T ckpt=1
row "ours bf16 (fp32=0)" python3 "$P/train.py" $T fp32=0
row "reference bf16 (fp32=0)" python3 "$P/run_ref.py" "$REF/torch_llama.py" $T fp32=0
row "ours amp=1 (fp32=0)" python3 "$P/train.py" $T fp32=0 amp=1
row "reference amp=1 (fp32=0)" python3 "$P/run_ref.py" "$REF/torch_llama.py" $T fp32=0 amp=1
M="moe_experts=4 moe_top_k=2 moe_shared=1"
row "ours MoE loop" python3 "$P/train.py" $T $M moe_impl=loop
row "reference MoE loop" python3 "$P/run_ref.py" "$REF/torch_llama.py" $T $M moe_impl=loop
row "ours MoE grouped" python3 "$P/train.py" $T $M
row "reference MoE grouped" python3 "$P/run_ref.py" "$REF/torch_llama.py" $T $M

echo "== two ranks, rank 0's loss (steps 1 and 5)"
row "ours DDP" $TR=2 "$P/train.py" $T
row "reference DDP" $TR=2 "$P/run_ref.py" "$REF/torch_llama.py" $T
row "ours FSDP" $TR=2 "$P/train.py" $T fsdp=1
row "reference FSDP" $TR=2 "$P/run_ref.py" "$REF/torch_llama.py" $T fsdp=1
echo "== the mean over the ranks per step, against one process drawing both ranks' batches"
curve "ours DDP, mean over ranks" loss_global $TR=2 "$P/train.py" $T
curve "ours one process, data_ranks=2" loss_global python3 "$P/train.py" $T data_ranks=2

echo "== tensor parallel, 2 ranks (one process above: same global batch)"
row "ours tp=2" $TR=2 "$P/train_tp.py" $T
row "reference tp=2" $TR=2 "$P/run_ref.py" "$REF/torch_llama_tp.py" $T
row "ours tp=1 (DDP)" $TR=2 "$P/train_tp.py" $T tp=1
row "reference tp=1 (DDP)" $TR=2 "$P/run_ref.py" "$REF/torch_llama_tp.py" $T tp=1

echo "== pipeline parallel, 2 ranks, n_layers=4, micro_batches=2"
row "ours one process, n_layers=4" python3 "$P/train.py" $T4
for s in gpipe 1f1b interleaved zbv; do
  row "ours $s" $TR=2 "$P/train_pp.py" $T4 micro_batches=2 schedule=$s
done
row "reference 1f1b (its stages seeded apart)" $TR=2 "$P/run_ref.py" "$REF/torch_llama_pp.py" $T4 micro_batches=2

if [ "${CHECK_FOUR:-0}" = 1 ]; then
  echo "== tensor parallel on 4 ranks (2 x tp=2), mean over ranks per step"
  curve "ours tp=2 x dp=2, dp_sync=1" loss_global $TR=4 "$P/train_tp.py" $T
  row "ours tp=2 x dp=2, dp_sync=0" $TR=4 "$P/train_tp.py" $T dp_sync=0
  row "reference tp=2 x dp=2 (no gradient sum)" $TR=4 "$P/run_ref.py" "$REF/torch_llama_tp.py" $T
fi
