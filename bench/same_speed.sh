#!/usr/bin/env bash
# Do two meshtrain binaries train at the same speed, in the same memory, on one GPU? For a
# change meant to leave the speed as it was (a refactor): the binaries run the same runs one
# after the other, alternating within each round so that the card's clocks drift on both
# alike, and the table gives each one's median tokens/s and peak memory and their ratio.
#   post-bf16, post-mixed  the post's model (embed_dim=1024 n_heads=8 n_layers=16
#                          batch_size=128 context_len=256), pure bf16 and mixed precision
#   ctx10k                 the same model at context_len=10000, batch_size=4 (mixed)
#   7b-offload             the 7.26B model (embed_dim=4096 n_heads=32 n_layers=48) on one GPU
#                          with offload=optimizer, activation checkpointing, batch_size=8,
#                          grad_accum_steps=32 (the host's update beside the GPU's work)
# Usage: bench/same_speed.sh OLD_BIN NEW_BIN            every run above
#        RUNS="post-bf16 post-mixed" bench/same_speed.sh OLD NEW
# REPS rounds (default 2), STEPS timed steps (default 30; the first step of a run is not
# timed); 7b-offload takes REPS_7B rounds of STEPS_7B steps (default 1 and 3: its init pins
# ~95 GiB of host memory, and a step is 32 micro-batches; its host update varies from run to
# run, so a difference of a few percent needs more of both). On an H200 the whole list takes
# about 6 minutes at STEPS=20, 7b-offload about 3.5 of them.
set -u
OLD=${1:?usage: bench/same_speed.sh OLD_BIN NEW_BIN} NEW=${2:?usage: bench/same_speed.sh OLD_BIN NEW_BIN}
REPS=${REPS:-2} STEPS=${STEPS:-30}
RUNS=${RUNS:-post-bf16 post-mixed ctx10k 7b-offload}
. "$(dirname "$0")/lib.sh"
for b in "$OLD" "$NEW"; do [ -x "$b" ] || { echo "same_speed: $b: not an executable" >&2; exit 2; }; done
POST="embed_dim=1024 n_heads=8 n_layers=16 device=cuda"
keys_of() {
  case $1 in
    post-bf16) echo "$POST batch_size=128 context_len=256 precision=bf16" ;;
    post-mixed) echo "$POST batch_size=128 context_len=256 precision=mixed" ;;
    ctx10k) echo "$POST batch_size=4 context_len=10000 precision=mixed" ;;
    7b-offload) echo "embed_dim=4096 n_heads=32 n_layers=48 context_len=256 device=cuda precision=mixed offload=optimizer" \
                     "activation_checkpointing=true batch_size=8 grad_accum_steps=32" ;;
    *) echo "same_speed: unknown run $1 (post-bf16 post-mixed ctx10k 7b-offload)" >&2; exit 2 ;;
  esac
}
echo "card: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
[ -s data/tinystories/train.bin ] || "$NEW" prepare >/dev/null
res=$(mktemp)
for run in $RUNS; do
  keys=$(keys_of "$run") || exit 2
  steps=$STEPS reps=$REPS
  [ "$run" = 7b-offload ] && steps=${STEPS_7B:-3} reps=${REPS_7B:-1}
  for ((r = 1; r <= reps; r++)); do
    # OLD first in odd rounds, NEW first in even ones
    for which in $([ $((r % 2)) = 1 ] && echo "old new" || echo "new old"); do
      BIN=$([ "$which" = old ] && echo "$OLD" || echo "$NEW")
      out=$(mktemp -d)
      d=$(mt_run "$out" 1 "" $keys steps=$((steps + 1)) log_every=$steps progress=false ckpt_path=none val_batches=1)
      t=$(field tokens_per_s "$d") m=$(field gpu_peak_alloc_bytes "$d") l=$(field loss "$d")
      if [ -z "$t" ]; then echo "$run $which round $r: failed: $(mt_failed "$out" 3)"; rm -rf "$out"; continue; fi
      printf '%-11s %-3s round %d  %9.0f tokens/s  %6.2f GiB  loss %s\n' "$run" "$which" "$r" "$t" "$(gib "$m" 2)" "$l"
      echo "$run $which $t $m $l" >>"$res"
      rm -rf "$out"
    done
  done
done
echo
echo "| run | old tokens/s | new tokens/s | new / old | old peak GiB | new peak GiB | final loss old / new |"
echo "|---|---|---|---|---|---|---|"
for run in $RUNS; do
  o=$(awk -v r="$run" '$1 == r && $2 == "old" {print $3}' "$res" | median)
  n=$(awk -v r="$run" '$1 == r && $2 == "new" {print $3}' "$res" | median)
  om=$(awk -v r="$run" '$1 == r && $2 == "old" {print $4}' "$res" | median)
  nm=$(awk -v r="$run" '$1 == r && $2 == "new" {print $4}' "$res" | median)
  ol=$(awk -v r="$run" '$1 == r && $2 == "old" {print $5}' "$res" | tail -1)
  nl=$(awk -v r="$run" '$1 == r && $2 == "new" {print $5}' "$res" | tail -1)
  ratio=$([ -n "$o" ] && [ -n "$n" ] && awk -v a="$o" -v b="$n" 'BEGIN {printf "%.4f", b / a}' || echo "-")
  printf '| %s | %s | %s | %s | %s | %s | %s / %s |\n' "$run" "${o:-failed}" "${n:-failed}" "$ratio" \
    "$([ -n "$om" ] && gib "$om" 2)" "$([ -n "$nm" ] && gib "$nm" 2)" "${ol:--}" "${nl:--}"
done
rm -f "$res"
