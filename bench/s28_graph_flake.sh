#!/usr/bin/env bash
# Session 28: test_train_cuda's layer_graphs_bitwise_accum3 (graphs on against MESHTRAIN_GRAPHS=0,
# grad_accum_steps=3) failed again on a fresh H200 (the second time in about seven test runs; 40
# runs of session 27's s27_graph_flake.sh were all alike). This runs the case's config for SECS
# seconds, alternating VARIANTS (each a set of environment settings; default: graphs on, graphs
# off), hashes every run's checkpoint, and then says, per variant, how many runs gave each hash;
# for every run off the most common hash, which tensors differ and how (ckpt_diff -v against a
# run of the most common hash) and its tuning and graphs lines. So: how rare, which side, where.
# HEAD=N: the data as tests/gpu/lib.sh makes it (the first N bytes of the 2 MiB head of TinyStories;
# the test's is 400000), else data/tinystories as prepared.
# Usage: SECS=420 bash bench/s28_graph_flake.sh BUILD   (BUILD holds meshtrain and tests/ckpt_diff)
set -u
B=$1 D=${D:-data/tinystories}
T=$(mktemp -d)
if [ -n "${HEAD:-}" ]; then
  D=$T/data
  head -c "$HEAD" data/tinystories/TinyStories-train.head-2MiB.txt >"$T/stories.txt"
  "$B/meshtrain" prepare input="$T/stories.txt" data_dir="$D" >/dev/null || exit 1
fi
[ -s "$D/train.bin" ] || "$B/meshtrain" prepare >/dev/null
G="vocab_size=50257 embed_dim=256 n_heads=4 n_layers=3 context_len=128 lr=1e-3 grad_clip=1 data_dir=$D steps=5"
G="$G device=${DEVICE:-cuda} precision=${PREC:-mixed} grad_accum_steps=3 batch_size=2 progress=false ${EXTRA:-}"
IFS=';' read -r -a V <<<"${VARIANTS:-MESHTRAIN_GRAPHS=1;MESHTRAIN_GRAPHS=0}"
end=$((SECONDS + ${SECS:-420}))
i=0
while [ $SECONDS -lt $end ]; do
  for v in "${!V[@]}"; do
    o=$T/r$i.v$v
    env ${V[$v]} "$B/meshtrain" train $G out_dir="$o" >"$o.log" 2>&1 || { echo "run $i variant $v failed: $(tail -1 "$o.log")"; continue; }
    echo "$v $(sha1sum <"$o/ckpt.bin" | cut -c1-12) $i" >>"$T/hashes"
  done
  i=$((i + 1))
done
top=$(cut -d' ' -f2 "$T/hashes" | sort | uniq -c | sort -rn | head -1 | awk '{print $2}')
ref=$(awk -v h="$top" '$2 == h {print $3 "." $1; exit}' "$T/hashes")
ref=$T/r${ref%.*}.v${ref#*.}
echo "$i rounds; the most common checkpoint hash $top"
for v in "${!V[@]}"; do
  echo "variant $v (${V[$v]}): $(awk -v v="$v" '$1 == v {print $2}' "$T/hashes" | sort | uniq -c | sort -rn | tr '\n' ' ')"
done
awk -v h="$top" '$2 != h' "$T/hashes" | head -${SHOW:-6} | while read -r v h r; do
  o=$T/r$r.v$v
  echo "-- run $r variant $v hash $h: against $(basename "$ref")"
  "$B/tests/ckpt_diff" -v "$ref/ckpt.bin" "$o/ckpt.bin" | head -12
  diff <(grep '"loss"' "$ref/log.jsonl" | sed 's/,"ms".*//') <(grep '"loss"' "$o/log.jsonl" | sed 's/,"ms".*//') | head -4
  grep -m1 '^matmul tuning' "$o.log" | cut -c1-100
  grep -m1 '^matmul tuning' "$ref.log" | cut -c1-100
done
