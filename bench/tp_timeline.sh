#!/usr/bin/env bash
# Where tensor parallel's step goes: the TP-efficiency model (embed_dim=4096
# n_heads=32 n_layers=8 context_len=4096 batch_size=1, pure bf16) on one GPU and at tp=t
# for each t in TPS, with and without sequence parallel.
#  - MESHTRAIN_TIMELINE=TL_STEP: on each rank, the step's length on the GPU and the TP
#    collectives' total time by kind (the compute stream waits for each, so all of it is
#    exposed), printed as one line a rank; the whole timeline kept in $OUT.
#  - MESHTRAIN_PROFILE=1 (steps 2-6, every op synchronised): the per-op table of one GPU and
#    of rank 0 at tp=t, side by side: an op whose time does not fall by t is replicated work.
# VARIANTS: environment settings to compare at each tp (';' between variants, spaces between
# the variables of one; default one variant, the plain run); TP_KEYS: more keys for the tp
# runs (e.g. tp_comm=collectives); PROFILE=0 leaves the profiles out.
# Usage: TPS="2 4" SPS="false true" [VARIANTS="NCCL_MAX_CTAS=8;NCCL_PROTO=Simple"] [TP_KEYS=...] bench/tp_timeline.sh [meshtrain]
set -u
BIN=${1:-build/meshtrain} TL_STEP=${TL_STEP:-3}
OUT=${OUT:-/tmp/tp_timeline}; mkdir -p "$OUT"
export MT_TIMEOUT=${MT_TIMEOUT:-240}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null
EFF="embed_dim=4096 n_heads=32 n_layers=8 context_len=4096 batch_size=1 device=cuda precision=bf16"
RUN="progress=false ckpt_path=none val_batches=1 log_every=1"

# summary FILE: one line a rank: the step (first to last mark), the TP collectives' and waits' sums,
# and how far the host kept ahead of the GPU
summary() {
  awk '$1 == "timeline" && $2 == "rank" { r = $3; sub(":", "", r); t = $4 + 0; if (t > last[r]) last[r] = t
         if ($6 == "comm" && $7 == "tensor-parallel" && $10 == "ms") { k = $8; ms[r, k] += $9; n[r, k]++; tot[r] += $9 } }
       $1 == "timeline" && $2 == "rank" && $6 == "compute" { l = $0; sub(/.* compute +/, "", l)
         if (l == "trunk forward done, head") fwd[r] = t; if (l == "head done, layers'"'"' backward") head[r] = t
         if (l == "backward done") bwd[r] = t }
       $1 == "timeline" && $4 == "host" { host[r] = $0; sub(/.*ms; /, "", host[r]) }
       END { for (r in last) { printf "  rank %s: step %.2f ms on the GPU (forward %.2f, head %.2f, backward %.2f, the rest %.2f); TP collectives %.2f ms (%.0f%%):",
                                 r, last[r], fwd[r], head[r] - fwd[r], bwd[r] - head[r], last[r] - bwd[r], tot[r],
                                 last[r] ? 100 * tot[r] / last[r] : 0
                               for (key in ms) { split(key, p, SUBSEP); if (p[1] == r) printf " %s %d x %.2f ms", p[2], n[key], ms[key] / n[key] }
                               if (r in host) printf "; host: %s", host[r]
                               printf "\n" } }' "$1" | sort
}

out=$(mktemp -d); d=$(mt_run "$out" 1 "MESHTRAIN_TIMELINE=$TL_STEP" $EFF $RUN steps=$((TL_STEP + 1)))
cp "$out/stdout" "$OUT/timeline_tp1.txt"
echo "== one GPU: $(field tokens_per_s "$d") tokens/s"; summary "$OUT/timeline_tp1.txt"
[ "${PROFILE:-1}" = 1 ] && { out=$(mktemp -d); mt_run "$out" 1 "MESHTRAIN_PROFILE=1" $EFF $RUN steps=6 >/dev/null
                             cp "$out/stdout" "$OUT/profile_tp1.txt"; }
IFS=';' read -r -a variants <<<"${VARIANTS:-}"; [ ${#variants[@]} -gt 0 ] || variants=("")
for t in ${TPS:-2}; do
  for sp in ${SPS:-false true}; do
   for v in "${variants[@]}"; do
    out=$(mktemp -d) tag=$(tr ' =' '_-' <<<"$v")
    d=$(mt_run "$out" "$t" "MESHTRAIN_TIMELINE=$TL_STEP $v" $EFF $RUN steps=$((TL_STEP + 1)) tensor_parallel_size=$t sequence_parallel=$sp ${TP_KEYS:-})
    cp "$out/stdout" "$OUT/timeline_tp${t}_sp$sp$tag.txt"
    echo "== tp=$t sequence_parallel=$sp${v:+ ($v)}: $(field tokens_per_s "$d") tokens/s"
    summary "$OUT/timeline_tp${t}_sp$sp$tag.txt"
   done
    [ "${PROFILE:-1}" = 1 ] || continue
    out=$(mktemp -d)
    mt_run "$out" "$t" "MESHTRAIN_PROFILE=1" $EFF $RUN steps=6 tensor_parallel_size=$t sequence_parallel=$sp ${TP_KEYS:-} >/dev/null
    cp "$out/stdout" "$OUT/profile_tp${t}_sp$sp.txt"
    echo "   per-op seconds (steps 2-6, every op synchronised), one GPU against tp=$t (a rank's, the first printed):"
    # the profile's lines: "  NAME  SECONDS s PCT% CALLS calls" (NAME may hold spaces)
    awk -v t="$t" 'FNR == 1 { f++ } /^ops profile/ { on = 1; next }
      on && $NF == "calls" { name = $0; sub(/^ +/, "", name); sub(/ +[0-9.]+ s +[0-9.]+% +[0-9]+ calls$/, "", name)
        if (f == 1) a[name] = $(NF - 4); else if (!(name in b)) { b[name] = $(NF - 4); order[++n] = name } }
      END { for (i = 1; i <= n; i++) { k = order[i]; printf "     %-30s %8.4f %8.4f  x%.2f of 1/%d\n", k, a[k], b[k], (a[k] > 0 ? b[k] * t / a[k] : 0), t } }' \
      "$OUT/profile_tp1.txt" "$OUT/profile_tp${t}_sp$sp.txt"
  done
done
