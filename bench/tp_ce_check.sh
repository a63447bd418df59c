#!/usr/bin/env bash
# A short check before the tp benchmarks (the whole of tests/gpu/test_multi_gpu.sh takes
# minutes): tp over NP GPUs in fp32 on a tiny model, with the collectives on NCCL's kernels
# and on the copy engines (MESHTRAIN_TP_CE=1; 1 and 4 chunks, with and without sequence
# parallel), each against one GPU (tests/gpu/lib.sh's close, 1e-4), the header naming the
# path, and at NP = 2 the copy engines' one-chunk runs bitwise the kernels'. Then the sums fused
# into the products (MESHTRAIN_TP_FUSED=1, CUDA IPC), with and without sequence parallel and
# beside the copy-engine all-gathers, each against one GPU, the header saying fused; modes 2
# (staging and copy engines), 3 (whole products, then copy engines) and 4 (the sums' products
# in groups of two blocks) alike, and mode 2 with MESHTRAIN_TP_WHOLE_COLS=48 (the backward's
# narrow products after a gather run whole) and with MESHTRAIN_TP_KEEP_GATHERED=1 (the forward's
# gathered norm outputs kept for the backward: at NP=2 bitwise mode 2's run), the gathers
# (without MESHTRAIN_TP_CE) straight into the other ranks' buffers, as the header says; and
# MESHTRAIN_TP_HALVES=1 (two halves of rows, interleaved, two fused sums in flight) under modes
# 1, 2 and 3, with checkpointing and with the kept gathers, the header naming the halves.
# Usage: NP=2 [ONLY=regex of case names] bash bench/tp_ce_check.sh   (MESHTRAIN_BIN, default build/meshtrain)
source "$(dirname "$0")/../tests/gpu/lib.sh"
NP=${NP:-2} B=4
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 lr=1e-3 grad_clip=1 steps=5 device=cuda data_dir=$D precision=fp32"
run() {  # run OUT NPROC ENVS KEYS...
  local out=$1 np=$2 envs=$3; shift 3
  if [ "$np" = 1 ]; then env $envs "$BIN" train "$@" out_dir="$out" progress=false >"$out.log" 2>&1
  else env $envs mpirun --allow-run-as-root --bind-to none --stdin none -np "$np" -x MESHTRAIN_TP_CE -x MESHTRAIN_TP_CHUNKS -x MESHTRAIN_TP_FUSED -x MESHTRAIN_TP_WHOLE_COLS -x MESHTRAIN_TP_KEEP_GATHERED -x MESHTRAIN_TP_HALVES \
         "$BIN" train "$@" comm_timeout=60 out_dir="$out" progress=false >"$out.log" 2>&1; fi
}
run "$TMP/one" 1 "" $M batch_size=$((NP * B))
while IFS='|' read -r name envs keys path; do
  [[ $name =~ ${ONLY:-.} ]] || continue
  out=$TMP/$name
  if run "$out" "$NP" "MESHTRAIN_TP_CE=0 MESHTRAIN_TP_CHUNKS=1 MESHTRAIN_TP_FUSED=0 MESHTRAIN_TP_WHOLE_COLS=0 MESHTRAIN_TP_KEEP_GATHERED=0 MESHTRAIN_TP_HALVES=0 $envs" $M batch_size=$((NP * B)) \
       tensor_parallel_size=$NP $keys &&
     grep -q "^tensor parallel collectives: $path" "$out.log" && close "$TMP/one" "$out" &&
     { [[ $envs != *FUSED=[1234]* ]] || grep -Eq "^tensor parallel: [1-9][0-9]* sums fused" "$out.log"; } &&
     { [[ $envs != *FUSED=[1234]* || $envs == *TP_CE=1* ]] || grep -q "^tensor parallel gathers: each rank's rows by copy engine straight" "$out.log"; } &&
     { [[ $envs != *HALVES=1* ]] || grep -q "^tensor parallel: each layer in two halves of rows" "$out.log"; }
  then ok "tp_$name"; else bad "tp_$name ($(grep -m1 '^tensor parallel collectives' "$out.log"; grep 'sums' "$out.log"; tail -2 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
nccl_sp||sequence_parallel=true|NCCL kernels
nccl_no_sp||sequence_parallel=false|NCCL kernels
ce_sp_c1|MESHTRAIN_TP_CE=1|sequence_parallel=true|copy engines
ce_no_sp_c1|MESHTRAIN_TP_CE=1|sequence_parallel=false|copy engines
ce_sp_c4|MESHTRAIN_TP_CE=1 MESHTRAIN_TP_CHUNKS=4|sequence_parallel=true|copy engines
ce_no_sp_c4|MESHTRAIN_TP_CE=1 MESHTRAIN_TP_CHUNKS=4|sequence_parallel=false|copy engines
fused_sp|MESHTRAIN_TP_FUSED=1|sequence_parallel=true|NCCL kernels
fused_no_sp|MESHTRAIN_TP_FUSED=1|sequence_parallel=false|NCCL kernels
fused_ce_sp|MESHTRAIN_TP_FUSED=1 MESHTRAIN_TP_CE=1|sequence_parallel=true|copy engines
fused_ac|MESHTRAIN_TP_FUSED=1|activation_checkpointing=true|NCCL kernels
fused2_sp|MESHTRAIN_TP_FUSED=2|sequence_parallel=true|NCCL kernels
fused2_no_sp|MESHTRAIN_TP_FUSED=2|sequence_parallel=false|NCCL kernels
fused2_ac|MESHTRAIN_TP_FUSED=2|activation_checkpointing=true|NCCL kernels
fused3_sp|MESHTRAIN_TP_FUSED=3|sequence_parallel=true|NCCL kernels
fused3_no_sp|MESHTRAIN_TP_FUSED=3|sequence_parallel=false|NCCL kernels
fused3_ac|MESHTRAIN_TP_FUSED=3|activation_checkpointing=true|NCCL kernels
fused4_sp|MESHTRAIN_TP_FUSED=4|sequence_parallel=true|NCCL kernels
fused4_no_sp|MESHTRAIN_TP_FUSED=4|sequence_parallel=false|NCCL kernels
fused4_ac|MESHTRAIN_TP_FUSED=4|activation_checkpointing=true|NCCL kernels
fused2_whole48|MESHTRAIN_TP_FUSED=2 MESHTRAIN_TP_WHOLE_COLS=48|sequence_parallel=true|NCCL kernels
fused2_keep|MESHTRAIN_TP_FUSED=2 MESHTRAIN_TP_KEEP_GATHERED=1|sequence_parallel=true|NCCL kernels
fused2_keep_ac|MESHTRAIN_TP_FUSED=2 MESHTRAIN_TP_KEEP_GATHERED=1|activation_checkpointing=true|NCCL kernels
halves2|MESHTRAIN_TP_FUSED=2 MESHTRAIN_TP_HALVES=1 MESHTRAIN_TP_CHUNKS=2|sequence_parallel=true|NCCL kernels
halves3|MESHTRAIN_TP_FUSED=3 MESHTRAIN_TP_HALVES=1 MESHTRAIN_TP_CHUNKS=2|sequence_parallel=true|NCCL kernels
halves1|MESHTRAIN_TP_FUSED=1 MESHTRAIN_TP_HALVES=1 MESHTRAIN_TP_CHUNKS=2|sequence_parallel=true|NCCL kernels
halves2_ac|MESHTRAIN_TP_FUSED=2 MESHTRAIN_TP_HALVES=1 MESHTRAIN_TP_CHUNKS=2|activation_checkpointing=true|NCCL kernels
halves2_keep|MESHTRAIN_TP_FUSED=2 MESHTRAIN_TP_HALVES=1 MESHTRAIN_TP_CHUNKS=2 MESHTRAIN_TP_KEEP_GATHERED=1|sequence_parallel=true|NCCL kernels
CASES
if [ "$NP" = 2 ] && [ -z "${ONLY:-}" ]; then
  for sp in sp no_sp; do
    d=$("$DIFF" "$TMP/nccl_$sp/ckpt.bin" "$TMP/ce_${sp}_c1/ckpt.bin" 2>&1)
    [ "$d" = "max_rel_diff 0" ] && ok "tp_ce_bitwise_nccl_$sp" || bad "tp_ce_bitwise_nccl_$sp ($d)"
  done
fi
if [ -s "$TMP/fused2_sp/ckpt.bin" ] && [ -s "$TMP/fused2_keep/ckpt.bin" ]; then
  d=$("$DIFF" "$TMP/fused2_sp/ckpt.bin" "$TMP/fused2_keep/ckpt.bin" 2>&1)
  [ "$d" = "max_rel_diff 0" ] && ok "tp_keep_gathered_bitwise_fused2" || bad "tp_keep_gathered_bitwise_fused2 ($d)"
fi
echo "RESULT $pass $fail"
