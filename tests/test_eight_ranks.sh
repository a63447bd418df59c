#!/usr/bin/env bash
# Eight CPU ranks (what CPU ranks can check of the 8-GPU layouts): DDP, FSDP, hybrid FSDP, 2 pipeline
# stages x 4 data-parallel ranks, 4 stages x 2 (ZeRO-1, interleaved), tensor parallel over
# all 8 (with and without sequence parallel) and tp 4 x dp 2 (DDP, FSDP) follow the
# single-process run of the same global batch (losses within 1e-5 relative over 5 steps,
# final parameters within 1e-5); a checkpoint of 8 ranks resumes on one process.
TEST_NAME=eight
source "$(dirname "$0")/lib.sh"
# Eight sanitized ranks on two cores take minutes; every layout here runs under the sanitizer
# at 2 and 4 ranks in the other scripts, so the sanitizer build leaves this one to the plain.
[ -z "${MESHTRAIN_SANITIZED:-}" ] || skip_all "test_eight_ranks: the plain build runs it (its layouts run sanitized at 2 and 4 ranks elsewhere)"
use_mpirun
prepare_data 300000

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=8 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D"
# cases MODEL REF: each "name|keys" line on stdin, run on 8 ranks, follows the run in REF
cases() {
  local model=$1 ref=$2 name keys out
  while IFS='|' read -r name keys; do
    out=$TMP/$name
    if $MPIRUN -np 8 "$BIN" train $model $keys out_dir="$out" </dev/null >"$out.log" 2>&1 && follows "$ref" "$out"
    then ok "np8_$name"; else bad "np8_$name ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
  done
}
"$BIN" train $M batch_size=16 out_dir="$TMP/ref" >/dev/null
cases "$M" "$TMP/ref" <<'CASES'
ddp|batch_size=2
fsdp|batch_size=2 fsdp=true
hybrid|batch_size=2 fsdp=true shard_strategy=hybrid shard_group_size=4
pp2_dp4|batch_size=4 pipeline_parallel_size=2 micro_batches=2
pp4_dp2_zero1_interleaved|batch_size=8 pipeline_parallel_size=4 micro_batches=4 pipeline_schedule=interleaved zero_opt=true
CASES

# tensor parallel over all eight (tp 8) and tp 4 x dp 2 (the 8-GPU long-context layouts),
# with and without sequence parallel, and beside FSDP: 8 heads
M8="vocab_size=50257 embed_dim=64 n_heads=8 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D"
"$BIN" train $M8 batch_size=8 out_dir="$TMP/ref8" >/dev/null
cases "$M8" "$TMP/ref8" <<'CASES'
tp8|batch_size=8 tensor_parallel_size=8
tp8_no_sp|batch_size=8 tensor_parallel_size=8 sequence_parallel=false
tp4_dp2|batch_size=4 tensor_parallel_size=4
tp4_dp2_fsdp|batch_size=4 tensor_parallel_size=4 fsdp=true
CASES

# the 8-rank FSDP checkpoint at step 3, resumed on one process to step 5
$MPIRUN -np 8 "$BIN" train ${M/steps=5/steps=3} batch_size=2 fsdp=true out_dir="$TMP/res" </dev/null >/dev/null 2>&1
"$BIN" train resume="$TMP/res/ckpt.bin" steps=5 data_dir="$D" progress=false threads=1 out_dir="$TMP/res" >/dev/null 2>&1
follows "$TMP/ref" "$TMP/res" && ok np8_fsdp_resumes_on_one_process || bad np8_fsdp_resumes_on_one_process
echo "RESULT $pass $fail"
