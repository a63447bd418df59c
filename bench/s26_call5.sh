#!/usr/bin/env bash
# Session 26, call 5 (one H200): layer graphs (MESHTRAIN_GRAPHS) on the post's model at
# micro-batches of 4, 32 and 128 sequences, against op by op, alternating, 2 rounds; then
# the GPU training tests (layer_graphs_bitwise_* among them).
# Usage: bench/s26_call5.sh BUILD OUTDIR
set -u
B=$1 O=$2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -s data/tinystories/train.bin ] || $B/meshtrain prepare > /dev/null
BIN=$B/meshtrain
. bench/lib.sh
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=mixed"
for r in 1 2; do
  for cfg in "batch_size=4 grad_accum_steps=32" "batch_size=32 grad_accum_steps=4" "batch_size=128 grad_accum_steps=1" \
             "batch_size=4 grad_accum_steps=1"; do
    for env in "MESHTRAIN_GRAPHS=0" "MESHTRAIN_GRAPHS=1"; do
      out=$(mktemp -d)
      d=$(MT_TIMEOUT=60 mt_run "$out" 1 "$env" $POST $cfg steps=21 log_every=20 progress=false ckpt_path=none val_batches=1)
      printf '%-36s %-20s round %d %9.0f tokens/s %5.2f GB  %s\n' "$cfg" "$env" $r "$(field tokens_per_s "$d")" \
        "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')" "$(grep -h "^layer graphs" $out/stdout)"
      [ -n "$d" ] || mt_failed "$out" 4
    done
  done
done
MESHTRAIN_BIN=$BIN timeout 420 bash tests/gpu/test_train_cuda.sh > $O/test_train_cuda.log 2>&1
grep -E "^(ok|FAIL|bad)|RESULT|graphs" $O/test_train_cuda.log | tail -70
