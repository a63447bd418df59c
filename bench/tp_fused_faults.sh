#!/usr/bin/env bash
# The fused sums (the default at tp 2 and 4 on GPUs) with a rank killed or hung at step 3: the
# job ends within seconds with a line naming it (tests/gpu/test_multi_gpu.sh has the same cases).
# Usage: [NP=4] bash bench/tp_fused_faults.sh   (MESHTRAIN_BIN, default build-gpu/fused/meshtrain)
export MESHTRAIN_BIN=${MESHTRAIN_BIN:-build-gpu/fused/meshtrain} NP=${NP:-2}
. tests/gpu/lib.sh
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 lr=1e-3 grad_clip=1 steps=50 device=cuda data_dir=$D precision=fp32 batch_size=4 tensor_parallel_size=$NP"
for f in "KILL 20 rank 1.*signal 9" "HANG 5 did not complete within 5 s"; do set -- $f; v=$1 ct=$2; shift 2; pat="$*"
  t0=$(date +%s); out=$(env MESHTRAIN_FAULT_$v=1:3 timeout 90 mpirun --allow-run-as-root --bind-to none --stdin none -np $NP $BIN train $M comm_timeout=$ct out_dir=$TMP/f$v 2>&1); rc=$?; t=$(( $(date +%s) - t0 ))
  echo "$out" | grep -q "sums: fused" && [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 60 ] && echo "$out" | grep -q "$pat" && echo "ok fused_$v (${t}s)" || echo "FAIL fused_$v rc=$rc t=$t $(tail -2 <<<"$out" | tr '\n' ' ')"
done
