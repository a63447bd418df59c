# Shared by the CPU test scripts (sourced, from the repository root): the binary, a scratch
# folder, pass/fail counting, Open MPI set up for a container and for ASan (use_mpirun),
# a small data set, expect_exit, and `follows REF RUN` (the single-process run against
# another layout's).
# tests/gpu/lib.sh is the GPU scripts' counterpart.
set -u
BIN=${MESHTRAIN_BIN:-build/meshtrain}
DIFF=$(dirname "$BIN")/tests/ckpt_diff
TMP=$(mktemp -d "/tmp/meshtrain-${TEST_NAME:-test}.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
pass=0; fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
# skip_all WHY: the whole script cannot run here (one line saying why); counted as one
# skipped test by scripts/run-tests.sh, never as a pass
skip_all() { echo "skip $1"; echo "RESULT 0 0 1"; exit 0; }
# use_mpirun: the scripts that start ranks with $MPIRUN call it first.
use_mpirun() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  # Quiet Open MPI's hints about the network of a container.
  export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
  # Under AddressSanitizer: Open MPI keeps allocations (some in components it unloads) until
  # exit, which LeakSanitizer would report; leaks of our own code are checked by the
  # single-process tests (which do not call this), running the same code.
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
  MPIRUN="mpirun --oversubscribe --bind-to none --stdin none"
}

# prepare_data BYTES: shards of the first BYTES of the mirrored TinyStories text in $D
D=$TMP/data
prepare_data() {
  head -c "$1" data/tinystories/TinyStories-train.head-2MiB.txt > "$TMP/stories.txt"
  "$BIN" prepare input="$TMP/stories.txt" data_dir="$D" "${@:2}" >/dev/null || { echo "RESULT 0 1"; exit 1; }
}

losses() { grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$1/log.jsonl" | cut -d: -f3; }
# follows REF RUN: every step's loss within 1e-5 relative, and the final parameters
follows() {
  local a b
  a=$(losses "$1"); b=$(losses "$2")
  [ -n "$a" ] && [ "$(echo "$a" | wc -l)" -eq "$(echo "$b" | wc -l)" ] || return 1
  paste <(echo "$a") <(echo "$b") | awk '{d=($1-$2)/$1; if (d<0) d=-d; if (d>1e-5) bad=1} END{exit bad}' || return 1
  params_close "$1/ckpt.bin" "$2/ckpt.bin"
}
# same_norms A B: every step's gradient norm within 1e-5 relative
norms() { grep -o '"grad_norm":[0-9.]*' "$1/log.jsonl" | cut -d: -f2; }
same_norms() {
  local a b; a=$(norms "$1"); b=$(norms "$2")
  [ -n "$a" ] && [ "$(echo "$a" | wc -l)" -eq "$(echo "$b" | wc -l)" ] &&
    paste <(echo "$a") <(echo "$b") | awk '{d=($1-$2)/$1; if (d<0) d=-d; if (d>1e-5) bad=1} END{exit bad}'
}
# rank_faults NAME WHAT KEYS...: two ranks train with KEYS; when rank 1 dies (SIGKILL) at step
# 3 the job ends within seconds, and when it hangs there the other gives up after comm_timeout=3
# with a message matching WHAT (the collective it waited in). Two checks: killed_NAME, hung_NAME.
rank_faults() {
  local name=$1 what=$2 t0 t rc out; shift 2
  t0=$SECONDS
  out=$(MESHTRAIN_FAULT_KILL=1:3 timeout 60 $MPIRUN -np 2 "$BIN" train "$@" out_dir="$TMP/kill_$name" 2>&1); rc=$?
  t=$((SECONDS - t0))
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 30 ] && grep -q "rank 1.*signal 9" <<<"$out" &&
    ok "killed_${name}_ends_job (${t}s)" || bad "killed_${name}_ends_job (exit $rc after ${t}s)"
  t0=$SECONDS
  out=$(MESHTRAIN_FAULT_HANG=1:3 timeout 60 $MPIRUN -np 2 "$BIN" train "$@" comm_timeout=3 out_dir="$TMP/hang_$name" 2>&1)
  rc=$?
  t=$((SECONDS - t0))
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 30 ] && grep -q "$what.*did not complete within 3 s" <<<"$out" &&
    ok "hung_${name}_times_out (${t}s)" ||
    bad "hung_${name}_times_out (exit $rc after ${t}s: $(grep meshtrain: <<<"$out" | head -2))"
}
# params_close A B: ckpt_diff A B succeeds and prints "max_rel_diff X" with X a number below
# PARAM_TOL (else it says what it saw). 1e-5; 5e-5 in the sanitizer build (-O1), whose code
# rounds otherwise than the plain build's -O3 (where, not located): there, on some CPUs, a
# pipeline of one-sequence micro-batches drifted 1.27e-5 from one process after 5 AdamW
# steps, as far as the -O1 and -O3 single-process runs drift from each other (1.29e-5).
PARAM_TOL=${PARAM_TOL:-$([ "${MESHTRAIN_SANITIZED:-}" = 1 ] && echo 5e-5 || echo 1e-5)}
params_close() {
  local d; d=$("$DIFF" "$1" "$2" 2>&1) || { echo "  ckpt_diff: $d"; return 1; }
  awk -v t="$PARAM_TOL" '$1 == "max_rel_diff" && $2 ~ /^[0-9.e+-]+$/ && $2 + 0 < t + 0 {ok = 1} END {exit !(ok && NR == 1)}' <<<"$d" ||
    { echo "  parameters: $d (tolerance $PARAM_TOL)"; return 1; }
}

# Under the sanitizer build (make test-asan: 5-10x slower) the case lists run a lighter half.
# skip_sanitized NAME: true there for a case whose name starts with "~" (its code paths are
# covered by the cases that stay; the plain build runs it, without the "~").
skip_sanitized() { [ -n "${MESHTRAIN_SANITIZED:-}" ] && [ "${1#\~}" != "$1" ]; }
# ties_for I: the tie_embeddings values of the I-th case: both in the plain build; one there,
# alternating by I so both still run across the list.
ties_for() {
  if [ -z "${MESHTRAIN_SANITIZED:-}" ]; then echo "false true"
  elif [ $(($1 % 2)) -eq 1 ]; then echo false; else echo true; fi
}

# expect_exit CODE PATTERN NAME -- CMD...: exit status CODE, exactly one line on stderr
# matching PATTERN, no crash.
expect_exit() {
  local code=$1 pat=$2 name=$3; shift 4
  local err rc
  err=$("$@" 2>&1 >/dev/null </dev/null); rc=$?
  local lines; lines=$(printf '%s' "$err" | grep -c '')
  if [ "$rc" -eq "$code" ] && [ "$lines" -eq 1 ] && printf '%s' "$err" | grep -qE "$pat"; then ok "$name"
  else bad "$name (exit $rc, want $code; stderr: $err)"; fi
}
