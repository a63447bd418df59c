# Shared by the GPU test scripts (sourced, from the repository root): the binary, a
# scratch folder, pass/fail counting, the data shards, and `close REF RUN` (every step's
# loss and the final parameters within TOL).
set -u
BIN=${MESHTRAIN_BIN:-build/meshtrain}
DIFF=$(dirname "$BIN")/tests/ckpt_diff
TMP=$(mktemp -d /tmp/meshtrain-gpu.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
pass=0; fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
TOL=1e-4

if [ -n "${MESHTRAIN_GPU_SHARDS:-}" ]; then D=$MESHTRAIN_GPU_SHARDS
else
  D=$TMP/data
  head -c 400000 data/tinystories/TinyStories-train.head-2MiB.txt > "$TMP/stories.txt" &&
    "$BIN" prepare input="$TMP/stories.txt" data_dir="$D" >/dev/null || { echo "cannot prepare data"; echo "RESULT 0 1"; exit 1; }
fi

losses() { grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$1/log.jsonl" | cut -d: -f3; }
# logged FIELD RUN: the last integer FIELD in RUN/log.jsonl (e.g. estimate_bytes)
logged() { grep -o "\"$1\":[0-9]*" "$2/log.jsonl" | tail -1 | cut -d: -f2; }
# within5 ESTIMATE PEAK: the estimate within 5% of the measured peak (both present)
within5() { [ -n "$1" ] && [ -n "$2" ] && awk -v e="$1" -v r="$2" 'BEGIN{d=(e-r)/r; if(d<0)d=-d; exit !(r > 0 && d < 0.05)}'; }
# close REF RUN: every step's loss within TOL relative, and the final parameters within TOL
close() {
  local a b d
  a=$(losses "$1"); b=$(losses "$2")
  [ -n "$a" ] && [ "$(echo "$a" | wc -l)" -eq "$(echo "$b" | wc -l)" ] || { echo "  different step counts"; return 1; }
  paste <(echo "$a") <(echo "$b") | awk -v t=$TOL '{d=($1-$2)/$1; if (d<0) d=-d; if (d>m) m=d; if (d>t) bad=1}
    END{printf "  losses: max relative difference %.3g over %d steps\n", m, NR; exit bad}' || return 1
  d=$("$DIFF" "$1/ckpt.bin" "$2/ckpt.bin") || return 1
  echo "  parameters: $d"
  echo "$d" | awk -v t=$TOL '{exit !($2 < t)}'
}
