#!/usr/bin/env bash
# Where gradient accumulation's per-token gap goes: the per-op totals of
# MESHTRAIN_PROFILE=$PROFILE (events, the default: CUDA events around each op, nothing waited
# for; 1: every op synchronised) over steps 2..STEPS+1, for each config in CFGS (the post's
# model in PREC on one GPU), side by side as ms per step, with each run's own step time.
# Usage: [PROFILE=events] [STEPS=5] CFGS="batch_size=128:grad_accum_steps=1 batch_size=32:grad_accum_steps=4" \
#        BIN=build/meshtrain bench/accum_profile.sh
set -u
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-build/meshtrain} STEPS=${STEPS:-5}
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=${PREC:-mixed}"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
tabs=$(mktemp -d) names=()
for cfg in ${CFGS:-batch_size=128:grad_accum_steps=1 batch_size=32:grad_accum_steps=4}; do
  out=$(mktemp -d)
  d=$(MESHTRAIN_PROFILE=${PROFILE:-events} mt_run "$out" 1 "" $POST ${cfg//:/ } steps=$((STEPS + 1)) log_every=$STEPS \
    progress=false ckpt_path=none val_batches=1)
  [ -n "$d" ] || { echo "$cfg: failed: $(mt_failed "$out" 3)"; continue; }
  names+=("$cfg")
  # "name<TAB>ms per step" per op, and the step itself (from tokens/s)
  sed -n '/ops profile/,$p' "$out/stdout" | awk -v s="$STEPS" '/ s +[0-9.]+% / {
      n = $0; sub(/^ +/, "", n); sub(/ +[0-9.]+ s +[0-9.]+% .*/, "", n)
      for (i = 1; i <= NF; i++) if ($(i + 1) == "s") { printf "%s\t%.3f\n", n, 1000 * $i / s; break } }' >"$tabs/${#names[@]}"
  awk -F'\t' '{s += $2} END {printf "the ops, summed\t%.3f\n", s}' "$tabs/${#names[@]}" >>"$tabs/${#names[@]}"
  tok=$(field tokens_per_s "$d") B=${cfg#batch_size=} B=${B%%:*} K=${cfg##*grad_accum_steps=}
  printf 'the step (from tokens/s)\t%.3f\n' "$(awk -v t="$tok" -v b="$B" -v k="$K" 'BEGIN {print 1000 * b * k * 256 / t}')" \
    >>"$tabs/${#names[@]}"
  echo "== $cfg: $(field tokens_per_s "$d") tokens/s"
done
# one row per op: its ms per step in each run, in the first run's order
printf '%-34s' "ms per step"
for c in "${names[@]}"; do b=${c#batch_size=} b=${b%%:*}; printf ' %12s' "b$b k${c##*grad_accum_steps=}"; done; echo
cat "$tabs"/[0-9]* | cut -f1 | awk '!s[$0]++' | while IFS= read -r op; do
  printf '%-34s' "$op"
  for ((i = 1; i <= ${#names[@]}; i++)); do
    printf ' %12s' "$(awk -F'\t' -v o="$op" '$1 == o {print $2}' "$tabs/$i")"
  done
  echo
done
