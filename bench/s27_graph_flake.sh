#!/usr/bin/env bash
# Session 27: test_train_cuda's layer_graphs_bitwise_accum3 failed once in three runs. Runs its
# pair (graphs on / MESHTRAIN_GRAPHS=0) ROUNDS times, then the same with matmul tuning off on
# both (MESHTRAIN_MATMUL_TUNE=0), and says per round whether losses and checkpoints match,
# with each run's tuning line and, where the checkpoints differ, ckpt_diff's figure.
# Usage: ROUNDS=4 bash bench/s27_graph_flake.sh BUILD   (BUILD holds meshtrain and tests/ckpt_diff)
set -u
B=$1 D=${D:-data/tinystories}
[ -s "$D/train.bin" ] || "$B/meshtrain" prepare >/dev/null
G="vocab_size=50257 embed_dim=256 n_heads=4 n_layers=3 context_len=128 lr=1e-3 grad_clip=1 data_dir=$D steps=5"
G="$G device=cuda precision=mixed grad_accum_steps=3 batch_size=2 progress=false"
T=$(mktemp -d)
strip() { grep '^{"step":[0-9]*,"loss"' "$1/log.jsonl" | sed 's/,"ms".*//'; }
cmp_runs() {  # cmp_runs A B: "same" or what differs
  local l c
  l=$([ -n "$(strip "$1")" ] && [ "$(strip "$1")" = "$(strip "$2")" ] && echo same || echo DIFFER)
  c=$(cmp -s "$1/ckpt.bin" "$2/ckpt.bin" && echo same || echo "DIFFER ($("$B/tests/ckpt_diff" "$1/ckpt.bin" "$2/ckpt.bin" 2>&1 | tail -1))")
  echo "losses $l, checkpoint $c"
}
for tune in 1 0; do
  for ((r = 1; r <= ${ROUNDS:-3}; r++)); do
    for run in on1 off1 on2 off2; do
      gr=0; [ "${run#on}" != "$run" ] && gr=1
      MESHTRAIN_MATMUL_TUNE=$tune MESHTRAIN_GRAPHS=$gr "$B/meshtrain" train $G out_dir="$T/t${tune}_r${r}_$run" \
        >"$T/t${tune}_r${r}_$run.log" 2>&1
    done
    p=$T/t${tune}_r${r}
    echo "tune=$tune round $r: on/off $(cmp_runs ${p}_on1 ${p}_off1) | on/on $(cmp_runs ${p}_on1 ${p}_on2) | off/off $(cmp_runs ${p}_off1 ${p}_off2)"
    for x in on1 off1 on2 off2; do echo "   $x: $(grep -m1 '^matmul tuning' "${p}_$x.log" | cut -c1-80) $(grep -m1 '^layer graphs' "${p}_$x.log" | cut -c1-60)"; done
  done
done
