#!/usr/bin/env bash
# Where the pipeline schedules lose time: step TL_STEP's timeline on every rank
# (MESHTRAIN_TIMELINE: each F/B/W action's start on the compute stream, each send and
# receive's span on its link stream) for each schedule in SCHEDS at pp=NP, m=M, the post's
# model in bf16. One file per schedule in $OUT (or /tmp), and each rank's busy fraction.
# Usage: NP=4 M=8 SCHEDS="1f1b zb1 gpipe interleaved" bench/pp_timeline.sh
set -u
NP=${NP:-4} M=${M:-8} TL_STEP=${TL_STEP:-5} SCHEDS=${SCHEDS:-1f1b zb1 gpipe interleaved}
O=${OUT:-/tmp}
BIN=${BIN:-build/meshtrain}
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=bf16 batch_size=128"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
for s in $SCHEDS; do
  MESHTRAIN_TIMELINE=$TL_STEP timeout 120 mpirun --allow-run-as-root --bind-to none --stdin none -np "$NP" \
    -x MESHTRAIN_TIMELINE "$BIN" train $POST pipeline_parallel_size="$NP" micro_batches="$M" pipeline_schedule="$s" \
    steps=$((TL_STEP + 1)) progress=false ckpt_path=none val_batches=1 out_dir=/tmp/tl_$s >"$O/timeline-$s.txt" 2>&1
  echo "== $s: $(grep -o '[0-9]* tokens/s' "$O/timeline-$s.txt" | head -1)"
  for r in $(seq 0 $((NP - 1))); do
    # the step's length and the first and last compute action on this rank
    grep "^timeline rank $r:" "$O/timeline-$s.txt" | awk -v r="$r" '
      $7 ~ /^[FBW][0-9]/ {if (first == "") first = $4; last = $4}
      /host: step synchronised/ {end = $4}
      END {printf "  rank %d: first action %.2f ms, last %.2f ms, step %.2f ms\n", r, first, last, end}'
  done
done
