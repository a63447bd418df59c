#!/usr/bin/env bash
# tp=4's quick call: each fused mode in MODES (default "2 4": the default, and the sums'
# products in groups of two blocks) against one GPU in fp32 on a tiny model (the parameters
# after 5 steps, tests/ckpt_diff), then the TP-efficiency rows of the collectives and of each
# mode (bench/tp_eff_rows.sh, REPS rounds).
# Usage: [MODES="2 3 4"] [REPS=2] bash bench/tp4_whole.sh [meshtrain]   (4 GPUs)
BIN=${1:-build/meshtrain} NP=${NP:-4} MODES=${MODES:-2 4}
D=$(mktemp -d); trap 'rm -rf "$D"' EXIT
"$BIN" prepare input=data/tinystories/TinyStories-train.head-2MiB.txt data_dir="$D" >/dev/null
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 lr=1e-3 grad_clip=1 steps=5 device=cuda data_dir=$D precision=fp32 progress=false batch_size=$((NP * 4))"
"$BIN" train $M out_dir="$D/one" >"$D/one.log" 2>&1
variants="MESHTRAIN_TP_FUSED=0"
for mode in $MODES; do
  MESHTRAIN_TP_FUSED=$mode mpirun --allow-run-as-root --bind-to none --stdin none -np "$NP" -x MESHTRAIN_TP_FUSED \
    "$BIN" train $M tensor_parallel_size=$NP comm_timeout=60 out_dir="$D/m$mode" >"$D/m$mode.log" 2>&1
  echo "tp=$NP mode $mode against one GPU (fp32): $(grep -m1 'sums:' "$D/m$mode.log"); $("$(dirname "$BIN")/tests/ckpt_diff" "$D/one/ckpt.bin" "$D/m$mode/ckpt.bin" 2>&1)"
  variants="$variants;MESHTRAIN_TP_FUSED=$mode"
done
NP=$NP REPS=${REPS:-1} VARIANTS="$variants" bash "$(dirname "$0")/tp_eff_rows.sh" "$BIN"
