#!/usr/bin/env bash
# One multi-GPU call's worth of DDP checks with one build B (default build/): the timeline
# of step TL_STEP (MESHTRAIN_TIMELINE) on one GPU and on every rank of NP-GPU DDP, for each
# "LABEL|KEYS[|VAR=v VAR2=w]" of TL (default: "plain|", precision=mixed; the environment
# is set on every rank, and on the one-GPU run), then the DDP variants given as
# arguments (bench/ddp_variants.sh), then the GPU tests (TESTS=all, multi, or none).
# Files go to $OUT: timeline-<np>-<label>.txt, variants.txt, tests.txt.
# Usage: B=build-x TL="plain|" bench/ddp_call.sh "1|1||precision=mixed" "ddp4|4||precision=mixed"
set -u
B=${B:-build}
OUT=${OUT:-/tmp}
NP=${NP:-4}
TL_STEP=${TL_STEP:-50}
nvidia-smi -L
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 device=cuda precision=mixed"
CFG="$CFG steps=$TL_STEP log_every=$TL_STEP progress=false ckpt_path=none val_batches=1"
IFS=';' read -r -a tls <<<"${TL:-plain|}"
for tl in "${tls[@]}"; do
  IFS='|' read -r label keys envs <<<"$tl"
  xs=()
  for e in $envs; do xs+=(-x "$e"); done
  env $envs MESHTRAIN_TIMELINE=$TL_STEP "$B/meshtrain" train $CFG $keys out_dir=/tmp/tl1 >"$OUT/timeline-1-$label.txt" 2>&1
  env $envs mpirun --allow-run-as-root --bind-to none --stdin none -np "$NP" -x MESHTRAIN_TIMELINE=$TL_STEP "${xs[@]}" \
    "$B/meshtrain" train $CFG $keys out_dir=/tmp/tl >"$OUT/timeline-$NP-$label.txt" 2>&1
  echo "timeline $label: $(grep -h '^done' "$OUT/timeline-1-$label.txt" "$OUT/timeline-$NP-$label.txt" | cut -c1-60 | tr '\n' ' ')"
done
[ $# -gt 0 ] && MESHTRAIN_BIN=$B/meshtrain STEPS=61 bench/ddp_variants.sh "$@" 2>/dev/null | tee "$OUT/variants.txt"
case ${TESTS:-all} in
  all) timeout 400 scripts/run-tests.sh "$B" gpu >"$OUT/tests.txt" 2>&1 ;;
  multi) MESHTRAIN_BIN=$B/meshtrain timeout 300 bash tests/gpu/test_multi_gpu.sh >"$OUT/tests.txt" 2>&1 ;;
  *) exit 0 ;;
esac
echo "tests rc=$?: $(grep -c '^ok' "$OUT/tests.txt") ok"; grep FAIL "$OUT/tests.txt"; tail -1 "$OUT/tests.txt"
