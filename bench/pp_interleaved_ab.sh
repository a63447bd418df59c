#!/usr/bin/env bash
# Interleaved's lists with and without the split backward (issue 18), in one call: the
# bubble table (bench/gpu_pipeline.sh, SCHEDS=interleaved) at NP stages for each m in MS with
# MESHTRAIN_INTERLEAVED_LISTS unset (the default: the shorter by simulation) and = unsplit,
# then step TL_STEP's timeline of each at m = TLM into $OUT/<lists>/ (bench/pp_timeline.sh).
# Usage: NP=4 MS="8 32" TLM=8 BIN=build/meshtrain bench/pp_interleaved_ab.sh
set -u
NP=${NP:-4} MS=${MS:-8 32} TLM=${TLM:-8}
D=$(dirname "$0")
for L in default unsplit; do
  echo "== MESHTRAIN_INTERLEAVED_LISTS=$L"
  if [ $L = default ]; then unset MESHTRAIN_INTERLEAVED_LISTS; else export MESHTRAIN_INTERLEAVED_LISTS=$L; fi
  NP=$NP MS="$MS" SCHEDS=interleaved bash "$D/gpu_pipeline.sh" none | grep -v "^    pipeline stage [1-9]"
  [ -n "$TLM" ] && mkdir -p "${OUT:-/tmp}/$L" && OUT="${OUT:-/tmp}/$L" NP=$NP M=$TLM SCHEDS=interleaved bash "$D/pp_timeline.sh"
done
unset MESHTRAIN_INTERLEAVED_LISTS
