#!/usr/bin/env bash
# Runs every test binary in $1/tests and every tests/test_*.sh, sums their RESULT lines
# ("RESULT passed failed [skipped]"), and prints "N passed, N failed" last, with
# ", N skipped" after it when a test could not run here (a skip is never a pass). Exit
# status is non-zero if anything failed.
# With "gpu" as $2: the GPU tests instead ($1/tests/gpu_test_* and tests/gpu/test_*.sh).
set -u
build=${1:-build}
export MESHTRAIN_BIN="$build/meshtrain"
if [ "${2:-}" = gpu ]; then tests=("$build"/tests/gpu_test_* tests/gpu/test_*.sh)
else tests=("$build"/tests/test_* tests/test_*.sh); fi
passed=0; failed=0; skipped=0
for t in "${tests[@]}"; do
  [ -e "$t" ] || continue
  if [[ $t == *test_multi_gpu* ]]; then  # several GPUs of one machine: needs 2 visible
    n_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    # CUDA_VISIBLE_DEVICES narrows what the ranks see (a comma-separated list of GPUs)
    [ -n "${CUDA_VISIBLE_DEVICES+x}" ] && n_gpus=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    if [ "$n_gpus" -lt 2 ]; then
      echo "== $t skipped ($n_gpus GPU(s) visible, needs 2)"; skipped=$((skipped + 1)); continue
    fi
  fi
  echo "== $t"
  t0=$SECONDS
  out=$( { if [[ $t == *.sh ]]; then bash "$t"; else "$t"; fi; } 2>&1); rc=$?
  echo "$out" | grep -v '^RESULT'
  echo "   ($t: $((SECONDS - t0)) s)"  # CI's budget is 30 minutes for make test and test-asan together
  res=$(echo "$out" | grep '^RESULT' | tail -1)
  if [ -z "$res" ]; then
    echo "FAIL $t exited with status $rc before reporting"; failed=$((failed + 1)); continue
  fi
  read -r _ p f s <<<"$res"
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + ${s:-0}))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then echo "FAIL $t exited with status $rc"; failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed$([ "$skipped" -gt 0 ] && echo ", $skipped skipped")"
[ "$failed" -eq 0 ]
