#!/usr/bin/env bash
# Gradient accumulation: grad_accum_steps=k micro-batches of batch_size B make the same
# optimizer step as one batch of k x B (the loss averaged over all the step's tokens), on
# one process and with every data-parallel strategy (k x B x ranks = 8 sequences):
# the losses within 1e-5 relative over 5 steps and the final parameters within 1e-5;
# steps, tokens/s and checkpoints count whole optimizer steps, and a resume keeps k.
TEST_NAME=accum
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 300000

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D"
for tied in false true; do
  "$BIN" train $M tie_embeddings=$tied batch_size=8 out_dir="$TMP/ref_$tied" >/dev/null
  for k in 1 2 4; do
    out=$TMP/k${k}_$tied
    if "$BIN" train $M tie_embeddings=$tied batch_size=$((8 / k)) grad_accum_steps=$k out_dir="$out" >"$out.log" 2>&1 &&
       follows "$TMP/ref_$tied" "$out" && grep -q "global batch: 8 sequences (batch_size $((8 / k)) x grad_accum_steps $k x dp 1)" "$out.log"
    then ok "accumulate_k${k}$([ $tied = true ] && echo _tied)"
    else bad "accumulate_k${k}$([ $tied = true ] && echo _tied) ($(tail -1 "$out.log"))"; fi
  done
done
# a control that must not follow: 2 micro-batches of 4 scaled as if each were the whole
# batch would double the gradient; here the same k with half the global batch differs
"$BIN" train $M batch_size=2 grad_accum_steps=2 out_dir="$TMP/half" >/dev/null 2>&1
follows "$TMP/ref_false" "$TMP/half" && bad "accumulate_control (a 4-sequence step followed the 8-sequence one)" ||
  ok accumulate_control

# cuda_graphs=true on the cpu, which records nothing: every layer call goes through the
# recordings' cache (src/model/layer_graphs.c) and runs op by op, as the same run without it
# (the GPU's replays: tests/gpu/test_train_cuda.sh); the retired variable is one line, exit 2
out=$TMP/graphs_cpu
if "$BIN" train $M batch_size=2 grad_accum_steps=4 activation_checkpointing=true cuda_graphs=true out_dir="$out" \
     >"$out.log" 2>&1 && follows "$TMP/ref_false" "$out" &&
   grep -q "^layer graphs: 0 recorded, 0 replayed, 96 layer calls op by op" "$out.log"
then ok accumulate_graphs_cpu
else bad "accumulate_graphs_cpu ($(grep "^layer graphs" "$out.log"; tail -1 "$out.log"))"; fi
MESHTRAIN_GRAPHS=1 "$BIN" train $M batch_size=8 out_dir="$TMP/graphs_retired" >"$TMP/graphs_retired.log" 2>&1
rc=$?
if [ $rc = 2 ] && [ "$(wc -l <"$TMP/graphs_retired.log")" = 1 ] && grep -q "MESHTRAIN_GRAPHS is no longer read: use the key cuda_graphs=" "$TMP/graphs_retired.log"
then ok accumulate_graphs_retired_variable
else bad "accumulate_graphs_retired_variable (exit $rc: $(head -2 "$TMP/graphs_retired.log"))"; fi

# with data parallelism: DDP and ZeRO-1 reduce once a step (after the last micro-batch),
# ZeRO-2, FSDP and hybrid FSDP add every micro-batch's reduced gradient into the shard
if command -v mpirun >/dev/null; then
  while IFS='|' read -r name np k tied keys; do
    out=$TMP/$name
    if $MPIRUN -np "$np" "$BIN" train $M tie_embeddings=$tied batch_size=$((8 / np / k)) grad_accum_steps=$k $keys \
         out_dir="$out" </dev/null >"$out.log" 2>&1 && follows "$TMP/ref_$tied" "$out" &&
       grep -q "global batch: 8 sequences (batch_size $((8 / np / k)) x grad_accum_steps $k x dp $np)" "$out.log"
    then ok "$name"; else bad "$name ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
  done <<'CASES'
ddp_np2_k2|2|2|false|
ddp_np2_k4|2|4|false|
ddp_np2_k2_tied|2|2|true|
zero1_np2_k2|2|2|false|zero_opt=true
zero2_np2_k2|2|2|false|fsdp=true shard_strategy=grad_op
fsdp_np1_k2|1|2|false|fsdp=true
fsdp_np2_k2|2|2|false|fsdp=true
fsdp_np2_k4_tied|2|4|true|fsdp=true
hybrid_np4_k2|4|2|false|fsdp=true shard_strategy=hybrid shard_group_size=2
CASES
fi

# the log counts whole optimizer steps, tokens/s counts every micro-batch's tokens
n=$(grep -c '^{"step":[0-9]*,"loss"' "$TMP/k4_false/log.jsonl")
[ "$n" -eq 5 ] && ok log_counts_optimizer_steps || bad "log_counts_optimizer_steps ($n lines)"

# resume: k and the global batch come from the checkpoint (steps 1-3, then 4-5)
"$BIN" train ${M/steps=5/steps=3} batch_size=2 grad_accum_steps=4 out_dir="$TMP/res" >/dev/null
out=$("$BIN" train resume="$TMP/res/ckpt.bin" data_dir="$D" steps=5 out_dir="$TMP/res" progress=false threads=1)
if grep -q "batch_size 2 x grad_accum_steps 4 x dp 1" <<<"$out" && follows "$TMP/ref_false" "$TMP/res"
then ok resume_keeps_accumulation; else bad "resume_keeps_accumulation"; fi
echo "RESULT $pass $fail"
