#!/usr/bin/env bash
# meshtrain plan's predicted step against the measured one on CPU ranks: calibrate this
# machine for a small model, plan every layout on up to 4 ranks (cluster=this
# devices_per_host=4), pick PER layouts of each world size (1, 2 and 4 ranks; evenly spread
# over the plan's order for that size, its best first, and the plan's overall pick), run each
# for STEPS steps exactly as the plan prints it, and report the mean absolute error of the
# step time, the rank correlation (Spearman) of predicted and measured, and whether the plan's
# pick is within 5% of the best measured. Writes a markdown report to stdout (and the raw
# lines to $OUT/rows.txt).
# Usage: [MODEL="embed_dim=.. n_heads=.. n_layers=.. context_len=.."] [G=global_batch] [PER=8] [STEPS=6] bench/plan_check.sh
# (bench/results/plan-epyc-2core-2026-12.md)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-"embed_dim=64 n_heads=4 n_layers=4 context_len=64"}
G=${G:-8}
PER=${PER:-8}
STEPS=${STEPS:-6}
OUT=${OUT:-$(mktemp -d /tmp/plan-check.XXXXXX)}
mkdir -p "$OUT"
make -s meshtrain >/dev/null
[ -s data/tinystories/train.bin ] || ./meshtrain prepare input=data/tinystories/TinyStories-train.head-2MiB.txt \
  data_dir=data/tinystories >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none

t0=$SECONDS
./meshtrain calibrate $MODEL global_batch=$G devices_per_host=4 out="$OUT/profile.txt" >"$OUT/calibrate.txt"
tcal=$((SECONDS - t0))
./meshtrain plan $MODEL global_batch=$G cluster=this devices_per_host=4 profile="$OUT/profile.txt" top=0 >"$OUT/plan.txt"

# one row per layout: index, world, predicted ms, what, command
awk '/^ *[0-9]+\. predicted/ {i = $1 + 0; p = $3; sub(/^[^:]*: /, ""); w = $0}
     /^    run: / {sub(/^    run: /, ""); np = 1; if ($1 == "mpirun") np = $3; print i "\t" np "\t" p "\t" w "\t" $0}' \
  "$OUT/plan.txt" >"$OUT/layouts.tsv"
: >"$OUT/pick.tsv"
for np in 1 2 4; do
  awk -F'\t' -v np=$np '$2 == np' "$OUT/layouts.tsv" >"$OUT/w$np.tsv"
  n=$(wc -l <"$OUT/w$np.tsv")
  [ "$n" -gt 0 ] || continue
  k=$((PER < n ? PER : n))
  for j in $(seq 0 $((k - 1))); do
    sed -n "$((1 + j * (n - 1) / (k > 1 ? k - 1 : 1)))p" "$OUT/w$np.tsv"
  done >>"$OUT/pick.tsv"
done
head -1 "$OUT/layouts.tsv" >>"$OUT/pick.tsv"
sort -t$'\t' -k1,1n -u "$OUT/pick.tsv" -o "$OUT/pick.tsv"

median_ms() {  # the median of the logged steps after the first
  grep -o '^{"step":[0-9]*,.*"ms":[0-9.]*' "$1" | awk -F'"ms":' '{split($1, a, /[:,]/); if (a[2] > 1) print $2}' |
    sort -g | awk '{v[NR] = $1} END {if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2}'
}
: >"$OUT/rows.txt"
while IFS=$'\t' read -r i np pred what cmd; do
  d="$OUT/run$i"
  if eval "$cmd data_dir=data/tinystories steps=$STEPS out_dir=$d ckpt_path=none progress=false val_batches=1" \
    >"$d.log" 2>&1 </dev/null; then
    printf '%s\t%s\t%s\t%s\t%s\n' "$i" "$np" "$pred" "$(median_ms "$d/log.jsonl")" "$what" >>"$OUT/rows.txt"
  else
    echo "layout $i failed: $cmd (see $d.log)" >&2
  fi
done <"$OUT/pick.tsv"

commit=$(git rev-parse --short HEAD)
python3 - "$OUT/rows.txt" "$commit" "$MODEL" "$G" "$PER" "$STEPS" "$tcal" "$(grep -m1 'searched in' "$OUT/plan.txt")" <<'EOF'
import sys
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1]) if l.strip()]
commit, model, G, PER, STEPS, tcal, searched = sys.argv[2:9]
def ranks(x):
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]: j += 1
        for k in range(i, j + 1): r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r
def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    n = len(a); ma = sum(ra) / n; mb = sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5; vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float('nan')
pred = [float(r[2]) for r in rows]; meas = [float(r[3]) for r in rows]
err = [abs(p - m) / m for p, m in zip(pred, meas)]
pick = min(range(len(rows)), key=lambda i: int(rows[i][0]))  # the plan's first
best = min(meas)
print(f"layouts run: {len(rows)} (1 rank: {sum(r[1] == '1' for r in rows)}, 2 ranks: {sum(r[1] == '2' for r in rows)}, "
      f"4 ranks: {sum(r[1] == '4' for r in rows)}); calibrate took {tcal} s; plan {searched.strip()}")
print()
print("| plan's rank | ranks | predicted ms | measured ms | error | layout |")
print("|---:|---:|---:|---:|---:|---|")
for r, e in zip(rows, err):
    print(f"| {r[0]} | {r[1]} | {float(r[2]):.1f} | {float(r[3]):.1f} | {100 * (float(r[2]) - float(r[3])) / float(r[3]):+.1f}% | {r[4]} |")
print()
print(f"- mean absolute error of the step time: {100 * sum(err) / len(err):.1f}% (goal: at most 15%)")
for np in ('1', '2', '4'):
    e = [x for x, r in zip(err, rows) if r[1] == np]
    if e: print(f"  - {np} rank{'s' if np != '1' else ''}: {100 * sum(e) / len(e):.1f}% over {len(e)}")
print(f"- rank correlation (Spearman) of predicted and measured: {spearman(pred, meas):.3f} (goal: at least 0.9)")
for np in ('1', '2', '4'):
    idx = [i for i, r in enumerate(rows) if r[1] == np]
    if len(idx) > 2: print(f"  - within {np} rank{'s' if np != '1' else ''}: {spearman([pred[i] for i in idx], [meas[i] for i in idx]):.3f}")
print(f"- the plan's pick (its #{rows[pick][0]}): measured {meas[pick]:.1f} ms against the best measured {best:.1f} ms "
      f"({100 * (meas[pick] / best - 1):+.1f}%; goal: within 5%): {'yes' if meas[pick] <= 1.05 * best else 'no'}")
EOF
