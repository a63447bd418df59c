#!/usr/bin/env bash
# Tensor parallel's default path (fused sums and gathers at tp 2 and 4 on GPUs, the buffers
# mapped by every rank of the group) beside the other axes on 4 GPUs: tp 2 x pp 2 (1F1B and
# zb1, each stage's activations mapped) and tp 2 x dp 2 (DDP and FSDP; batch_size is a dp
# replica's), each following one GPU at the same global batch in fp32 (tests/gpu/lib.sh's close, 1e-4), the header saying
# the sums are fused and the gathers go straight. TP_COMM=collectives runs the same layouts on the collectives.
# Usage: [TP_COMM=...] bash bench/tp_layouts_check.sh   (4 GPUs; MESHTRAIN_BIN, default build/meshtrain)
. "$(dirname "$0")/../tests/gpu/lib.sh"
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=4 context_len=64 lr=1e-3 grad_clip=1 steps=5 device=cuda data_dir=$D precision=fp32 progress=false"
"$BIN" train $M batch_size=8 out_dir="$TMP/one" >"$TMP/one.log" 2>&1
while IFS='|' read -r name keys; do
  out=$TMP/$name
  [[ $name =~ ${ONLY:-.} ]] || continue
  if mpirun --allow-run-as-root --bind-to none --stdin none -np 4 "$BIN" train $M $keys ${TP_COMM:+tp_comm=$TP_COMM} comm_timeout=60 out_dir="$out" >"$out.log" 2>&1 &&
     { [ "${TP_COMM:-}" = collectives ] || grep -q "^tensor parallel sums: fused into the products, copy engines and CUDA IPC (tp_comm=" "$out.log"; } && close "$TMP/one" "$out"
  then ok "tp_$name"; else bad "tp_$name ($(grep -m1 '^tensor parallel sums' "$out.log"; tail -2 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
pp2_1f1b|batch_size=8 tensor_parallel_size=2 pipeline_parallel_size=2 micro_batches=4
pp2_zb1|batch_size=8 tensor_parallel_size=2 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=zb1
dp2_ddp|batch_size=4 tensor_parallel_size=2
dp2_fsdp|batch_size=4 tensor_parallel_size=2 fsdp=true
CASES
echo "RESULT $pass $fail"
