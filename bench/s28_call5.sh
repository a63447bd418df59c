#!/usr/bin/env bash
# Session 28, call 5 (little device time left): test_train_cuda.sh's own cases for matmul tuning
# (now opt-in), the layer graphs (accum3 among them) and MESHTRAIN_PROFILE=events, cut out of the
# script with its header, with the final binary.
# Usage: MESHTRAIN_BIN=B/meshtrain bash bench/s28_call5.sh
set -u
t=tests/gpu/test_train_cuda.sh
s=$(dirname "$t")/.s28_subset.sh
{ sed -n '1,/^# -- a long context/p' "$t" | sed '$d'
  sed -n '/^# -- matmul tuning/,/^# -- CUDA follows the CPU/p' "$t" | sed '$d'
  echo 'echo "RESULT $pass $fail"'; } >"$s"
bash "$s"; rc=$?; rm -f "$s"; exit $rc
