#!/usr/bin/env bash
# PipeDream-2BW (and PipeDream) against 1F1B on CPU ranks: `make train`'s CPU model (its keys,
# steps=N) at pipeline_parallel_size=2, micro_batches=4, once with each schedule. Prints the
# training loss every 50 steps and the validation losses side by side, then each run's mean
# step time after the first (the runs share the machine's cores: 2 ranks x 1 thread).
# Usage: [SHAPE="embed_dim=.. n_heads=.. n_layers=.. context_len=.. batch_size=.."] [LR="lr=.. min_lr=.."]
#        [SCHEDULES="1f1b 2bw pipedream"] [CLIP=0] bench/pp_2bw_cpu.sh [steps]
# (pipedream updates each stage on its own: it runs with CLIP=0, which the others then take too)
# (500 by default; bench/results/pipedream-epyc-2core-2026-12.md)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-500}
make -s meshtrain >/dev/null
[ -s data/tinystories/train.bin ] || ./meshtrain prepare input=data/tinystories/TinyStories-train.head-2MiB.txt \
  data_dir=data/tinystories >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
# SHAPE: the model's shape keys (make train's CPU model by default; a busy 2-core machine
# takes it at 3-4 s a step, so the figures came from a smaller one, see the results file)
SHAPE=${SHAPE:-"embed_dim=128 n_heads=4 n_layers=4 context_len=128 batch_size=16"}
LR=${LR:-"lr=3e-3 min_lr=3e-4"}  # (make train's; LR="lr=1e-3 min_lr=1e-4" for a gentler one)
SCHEDULES=${SCHEDULES:-"1f1b 2bw"}
CLIP=${CLIP:-1.0}
MODEL="$SHAPE steps=$steps $LR
  lr_schedule=cosine warmup_steps=30 grad_clip=$CLIP weight_decay=0.1 val_every=100 val_batches=16 ckpt_every=100
  progress=false threads=1 pipeline_parallel_size=2 micro_batches=4"
out=$(mktemp -d)
for s in $SCHEDULES; do
  mpirun --oversubscribe --bind-to none --stdin none -np 2 ./meshtrain train $MODEL pipeline_schedule=$s \
    out_dir="$out/$s" >"$out/$s.log"
done
col() { grep -o "^{\"step\":[0-9]*,\"$2\":[0-9.]*" "$out/$1/log.jsonl" | tr -d '{"' | tr ':,' '  ' | awk '{print $2, $4}'; }
table() {  # table COLUMN EVERY: the schedules side by side
  local first=1 t=$out/table
  for s in $SCHEDULES; do
    if [ $first = 1 ]; then col $s $1 >"$t"; first=0; else join "$t" <(col $s $1) >"$t.new"; mv "$t.new" "$t"; fi
  done
  echo "| step |$(for s in $SCHEDULES; do printf ' %s %s |' $s $1; done)"
  echo "|---:|$(for s in $SCHEDULES; do printf -- '---:|'; done)"
  awk -v e="$2" '$1 == 1 || $1 % e == 0 {printf "| %d |", $1; for (i = 2; i <= NF; i++) printf " %.4f |", $i; printf "\n"}' "$t"
}
table loss 50
echo
table val_loss 1
echo
for s in $SCHEDULES; do
  grep -o '^{"step":[0-9]*,"loss".*"ms":[0-9.]*' "$out/$s/log.jsonl" | grep -o '"ms":[0-9.]*' | cut -d: -f2 |
    awk -v s=$s 'NR > 1 {t += $1; n++} END {printf "%s: %.1f ms a step (mean of %d after the first)", s, t / n, n}'
  # the measured idle share: each rank's time blocked in communication over the timed steps
  grep '"done":true' "$out/$s/log.jsonl" | python3 -c 'import json, sys; d = json.loads(sys.stdin.read())
print(", blocked %.3f of the step (mean over ranks), %.3f at most" % (d["blocked_fraction"], d["blocked_fraction_max"])
      if "blocked_fraction" in d else "")'
done
rm -rf "$out"
