#!/usr/bin/env bash
# Several GPUs of one machine (NCCL): `mpirun -np 2 meshtrain train device=cuda ...
# batch_size=B` against one GPU with batch_size=2B (the same global batches): every step's
# loss within 1e-4 relative and the final parameters within 1e-4 (norm-wise per tensor,
# tests/ckpt_diff), in fp32, for DDP, ZeRO-1, ZeRO-2, FSDP (tied embeddings) and hybrid
# sharding (shard groups of 1, the gradient averaged across 2 replicas); and in mixed
# precision (bf16 roundings differ with the batch's shape) within 2e-2, for DDP and FSDP;
# and in pure bf16 (bf16 gradients, reduced in bf16) within 2e-2, for DDP, ZeRO-2 and
# FSDP. DDP reduces on the copy engines (also in pieces) or, with copy_engines=false, with
# NCCL's all-reduce. Tensor parallel over the GPUs (vocabulary-parallel head, with and
# without sequence parallel, tied and untied) follows one GPU in fp32, on NCCL's collectives
# (tp_comm=collectives) and with its sums and gathers fused into the products (tp_comm=fused,
# the default at tp 2 and 4). Pipeline
# send/receive on the copy engines (pp_copy_engines=true, the default) is bitwise NCCL's (pp_copy_engines=false). A rank that is killed, or hangs, ends the job within seconds with a message
# (DDP and FSDP; pipeline stages on the copy engines), as on CPU ranks. offload=optimizer with ZeRO-2, FSDP and DDP follows the
# same run without offload (fp32 1e-5 over 20 steps; mixed within the mixed tolerance);
# offload=params (the FSDP shards in host memory too) as well. Layer graphs
# (cuda_graphs=true) under DDP, FSDP and pipeline schedules are bitwise the runs op by op.
#
# Needs 2 GPUs (scripts/run-tests.sh skips it with fewer), mpirun, a meshtrain built with
# NCCL ($MESHTRAIN_BIN, default build/meshtrain) and build/tests/ckpt_diff beside it. Data:
# MESHTRAIN_GPU_SHARDS=DIR holding train.bin and val.bin, or else prepared here from
# data/tinystories/TinyStories-train.head-2MiB.txt (run from the repository root).
source "$(dirname "$0")/lib.sh"
NP=${MESHTRAIN_GPU_NP:-2}

run1() {  # run1 OUT KEYS...: one process, one GPU
  local out=$1; shift
  "$BIN" train "$@" out_dir="$out" progress=false >"$out.log" 2>&1
}
runn() {  # runn OUT KEYS...: NP processes, one GPU each
  local out=$1; shift
  timeout 600 mpirun --allow-run-as-root --bind-to none --stdin none -np "$NP" \
    "$BIN" train "$@" comm_timeout=120 out_dir="$out" progress=false >"$out.log" 2>&1
}

B=4
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 lr=1e-3 grad_clip=1 steps=5 device=cuda data_dir=$D precision=fp32"

# -- two processes run at all (else one clear failure, not a page of them)
if ! runn "$TMP/smoke" ${M/steps=5/steps=1} batch_size=$B; then
  echo "mpirun -np $NP ... device=cuda does not run here:"; tail -5 "$TMP/smoke.log"; echo "RESULT 0 1"; exit 1
fi

# -- NP GPUs with batch_size=B follow one GPU with batch_size=NP*B, per strategy
for tied in false true; do run1 "$TMP/one_$tied" $M tie_embeddings=$tied batch_size=$((NP * B)); done
while IFS='|' read -r name tied keys; do
  out=$TMP/np_$name
  if runn "$out" $M tie_embeddings=$tied batch_size=$B $keys && close "$TMP/one_$tied" "$out"
  then ok "multi_gpu_follows_one_gpu_$name"
  else bad "multi_gpu_follows_one_gpu_$name ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
ddp|false|
ddp_tied|true|
ddp_unit_buckets|false|bucket_mb=0
ddp_nccl_allreduce|false|copy_engines=false
zero1|false|zero_opt=true
zero2|false|fsdp=true shard_strategy=grad_op
fsdp_tied|true|fsdp=true shard_strategy=full
hybrid|false|fsdp=true shard_strategy=hybrid shard_group_size=1
CASES
# -- tensor parallel over the NP GPUs (dp = 1, so batch_size is the whole batch): heads, FFN
# units and the vocabulary split (the cross-entropy's statistics all-gathered over NCCL),
# with sequence parallel (all-gathers and reduce-scatters of bf16 or fp32 activations) and
# without, and with activation checkpointing: NP GPUs follow one (on the collectives:
# tp_comm=collectives, as the header says; the fused sums, the default at tp 2 and 4, below)
while IFS='|' read -r name tied keys; do
  out=$TMP/tp_$name
  if runn "$out" $M tie_embeddings=$tied batch_size=$((NP * B)) tensor_parallel_size=$NP tp_comm=collectives $keys &&
     grep -q "^tensor parallel sums: collectives (tp_comm=collectives)" "$out.log" && close "$TMP/one_$tied" "$out"
  then ok "multi_gpu_tp_follows_one_gpu_$name"
  else bad "multi_gpu_tp_follows_one_gpu_$name ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
sp|false|
sp_tied|true|
no_sp|false|sequence_parallel=false
no_sp_tied|true|sequence_parallel=false
sp_ckpt|false|activation_checkpointing=true
CASES
# grows_alike NAME WITH WITHOUT: run WITH's estimate is above run WITHOUT's, and grows by
# what its peak grows by, within 5% of WITH's peak
grows_alike() {
  local name=$1 ew pw eo po
  ew=$(logged estimate_bytes "$2") pw=$(logged gpu_peak_alloc_bytes "$2")
  eo=$(logged estimate_bytes "$3") po=$(logged gpu_peak_alloc_bytes "$3")
  echo "  $name: estimate $ew, peak $pw; without: estimate $eo, peak $po"
  if [ -n "$ew" ] && [ -n "$pw" ] && [ -n "$eo" ] && [ -n "$po" ] && [ "$ew" -gt "$eo" ] &&
     awk -v a=$((ew - eo)) -v b=$((pw - po)) -v p="$pw" 'BEGIN{d=a-b; if(d<0)d=-d; exit !(d < 0.05 * p)}'
  then ok "$name"; else bad "$name"; fi
}
# -- tensor parallel's sums and gathers fused into the products (tp_comm=fused, the default at
# tp 2 and 4: the other ranks' rows by copy engine into their memory through CUDA IPC, the
# gathers straight into the other ranks' buffers): with and without sequence parallel, tied,
# with activation checkpointing, NP GPUs follow one; the header says fused (and that the
# gathers go straight: no "through slots") and the summary counts the sums; the estimate
# counts the slots and the mapped buffers' pages (it grows by what the peak grows by)
while IFS='|' read -r name tied keys; do
  out=$TMP/tp_fused_$name
  if runn "$out" $M tie_embeddings=$tied batch_size=$((NP * B)) tensor_parallel_size=$NP tp_comm=fused $keys &&
     grep -q "^tensor parallel sums: fused into the products, copy engines and CUDA IPC (tp_comm=fused)" "$out.log" &&
     grep -Eq "^tensor parallel: [1-9][0-9]* sums fused" "$out.log" && close "$TMP/one_$tied" "$out"
  then ok "multi_gpu_tp_fused_follows_one_gpu_$name"
  else bad "multi_gpu_tp_fused_follows_one_gpu_$name ($(grep -m1 'sums' "$out.log"; tail -3 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
sp|false|
sp_tied|true|
no_sp|false|sequence_parallel=false
no_sp_tied|true|sequence_parallel=false
sp_ckpt|false|activation_checkpointing=true
CASES
# ... which at tp 2 and 4 is the default (elsewhere the collectives, until measured)
if [ "$NP" = 2 ] || [ "$NP" = 4 ]; then
  out=$TMP/tp_default
  if runn "$out" $M batch_size=$((NP * B)) tensor_parallel_size=$NP &&
     grep -q "^tensor parallel sums: fused into the products, copy engines and CUDA IPC (tp_comm=auto)" "$out.log" &&
     close "$TMP/one_false" "$out"
  then ok multi_gpu_tp_fused_by_default_at_tp$NP
  else bad "multi_gpu_tp_fused_by_default_at_tp$NP ($(grep -m1 'sums' "$out.log"; tail -2 "$out.log" | tr '\n' ' '))"; fi
fi
grows_alike multi_gpu_tp_fused_estimate_counts_slots "$TMP/tp_fused_sp" "$TMP/tp_sp"
# -- the timeline on the fused path (MESHTRAIN_TIMELINE=3, MESHTRAIN_TIMELINE_LEADS=1): on every
# rank the compute stream's waits for a gather's rows as spans, and how far the host kept
# ahead of the GPU, at every compute mark and in one line
out=$TMP/tp_timeline
if (export MESHTRAIN_TIMELINE=3 MESHTRAIN_TIMELINE_LEADS=1
    runn "$out" $M batch_size=$((NP * B)) tensor_parallel_size=$NP sequence_parallel=true tp_comm=fused); then
  tl_ok=1
  for ((r = 0; r < NP; r++)); do
    lines=$(grep "^timeline rank $r:" "$out.log")
    grep -q "comm     tensor-parallel gather-wait " <<<"$lines" && grep -q "host enqueued up to the last mark in" <<<"$lines" &&
      grep -Eq "lead +-?[0-9.]+ ms \(host" <<<"$lines" || tl_ok=0
  done
  [ "$tl_ok" = 1 ] && ok multi_gpu_tp_timeline_gather_waits_and_host_lead ||
    bad "multi_gpu_tp_timeline_gather_waits_and_host_lead ($(grep -c 'gather-wait' "$out.log") gather-waits, $(grep -c 'host enqueued' "$out.log") host lines)"
else bad "multi_gpu_tp_timeline_gather_waits_and_host_lead ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
# -- optimizer=adafactor: ZeRO-2 and FSDP shard the matrices mid-row over the GPUs; the row
# and column sums of g^2 go through an NCCL all-reduce: NP GPUs follow one. So does tensor
# parallel over the NP GPUs (dp = 1), whose slices' sums are all-reduced over the tp group
run1 "$TMP/af_one" $M optimizer=adafactor batch_size=$((NP * B))
for keys in "fsdp=true shard_strategy=grad_op" "fsdp=true shard_strategy=full" "tensor_parallel_size=$NP"; do
  name=${keys##*=} b=$B
  [ "$keys" = "tensor_parallel_size=$NP" ] && name=tp$NP b=$((NP * B))  # dp = 1: the whole batch
  out=$TMP/af_np_$name
  if runn "$out" $M optimizer=adafactor batch_size=$b $keys && close "$TMP/af_one" "$out"
  then ok "multi_gpu_adafactor_follows_one_gpu $name"
  else bad "multi_gpu_adafactor_follows_one_gpu $name ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done
# -- pipeline parallel: NP stages (one data-parallel rank, so batch_size=NP*B) follow one GPU
# too, under every schedule; activations and their gradients go by NCCL send/receive
# (pp_copy_engines=false; the copy engines' runs below must be bitwise these) on two-rank groups,
# one per neighbour and direction (interleaved goes round the ring)
while IFS='|' read -r name tied keys; do
  out=$TMP/pp_$name
  if runn "$out" $M tie_embeddings=$tied batch_size=$((NP * B)) pipeline_parallel_size=$NP $keys pp_copy_engines=false &&
     close "$TMP/one_$tied" "$out"
  then ok "multi_gpu_pipeline_follows_one_gpu_$name"
  else bad "multi_gpu_pipeline_follows_one_gpu_$name ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
1f1b|false|micro_batches=2
gpipe_tied|true|micro_batches=4 pipeline_schedule=gpipe
1f1b_m8_tied|true|micro_batches=8
zb1|false|micro_batches=4 pipeline_schedule=zb1
zb1_tied|true|micro_batches=8 pipeline_schedule=zb1
CASES
# interleaved needs 2 layers per rank: 4 stages of one layer over NP=2 ranks against 1F1B's
# 2 stages of two layers, the same arithmetic in another order
for sched in 1f1b interleaved; do
  runn "$TMP/pp4l_$sched" ${M/n_layers=2/n_layers=4} tie_embeddings=true batch_size=$((NP * B)) \
    pipeline_parallel_size=$NP micro_batches=4 pipeline_schedule=$sched pp_copy_engines=false
done
close "$TMP/pp4l_1f1b" "$TMP/pp4l_interleaved" && ok multi_gpu_pipeline_interleaved_follows_1f1b ||
  bad "multi_gpu_pipeline_interleaved_follows_1f1b ($(tail -3 "$TMP/pp4l_interleaved.log" | tr '\n' ' '))"
# -- pipeline send/receive on the copy engines (pp_copy_engines=true: CUDA IPC rings, stream
# memory operations, no SM): the header says so, and it moves the same bytes as NCCL's
# kernels, so each run is bitwise its NCCL run above (1F1B, zb1 with its head split, tied, and
# interleaved round the ring); its estimate grows by the rings, as its peak does (within 5% of
# the rings: nothing else the allocator counts differs)
# (NAME|THE RUN IT FOLLOWS|ITS NCCL RUN|TIED|KEYS)
while IFS='|' read -r name like ref tied keys; do
  out=$TMP/pp_ce_$name
  if runn "$out" $keys tie_embeddings=$tied batch_size=$((NP * B)) pipeline_parallel_size=$NP &&
     grep -q "^pipeline send/receive: copy engines (" "$out.log" && close "$TMP/$like" "$out"
  then ok "multi_gpu_pipeline_ce_follows_${like}_$name"
  else bad "multi_gpu_pipeline_ce_follows_${like}_$name ($(grep -m1 '^pipeline send/receive' "$out.log"; tail -3 "$out.log" | tr '\n' ' '))"; fi
  d=$("$DIFF" "$TMP/$ref/ckpt.bin" "$out/ckpt.bin" 2>&1)
  [ "$d" = "max_rel_diff 0" ] && ok "multi_gpu_pipeline_ce_bitwise_nccl_$name" || bad "multi_gpu_pipeline_ce_bitwise_nccl_$name ($d)"
done <<CASES
1f1b|one_false|pp_1f1b|false|$M micro_batches=2
zb1_tied|one_true|pp_zb1_tied|true|$M micro_batches=8 pipeline_schedule=zb1
interleaved|pp4l_1f1b|pp4l_interleaved|true|${M/n_layers=2/n_layers=4} micro_batches=4 pipeline_schedule=interleaved
CASES
ec=$(logged estimate_bytes "$TMP/pp_ce_1f1b") pc=$(logged gpu_peak_alloc_bytes "$TMP/pp_ce_1f1b")
en=$(logged estimate_bytes "$TMP/pp_1f1b") pn=$(logged gpu_peak_alloc_bytes "$TMP/pp_1f1b")
echo "  pipeline copy engines: estimate $ec, peak $pc; NCCL kernels: estimate $en, peak $pn"
if [ -n "$ec" ] && [ -n "$pc" ] && [ -n "$en" ] && [ -n "$pn" ] && [ "$ec" -gt "$en" ] &&
   awk -v a=$((ec - en)) -v b=$((pc - pn)) 'BEGIN{d=a-b; if(d<0)d=-d; exit !(d <= 0.05 * a)}'
then ok multi_gpu_pipeline_ce_estimate_counts_rings; else bad multi_gpu_pipeline_ce_estimate_counts_rings; fi
grep -q "^pipeline send/receive: NCCL kernels (pp_copy_engines=false)" "$TMP/pp_1f1b.log" && ok multi_gpu_pipeline_ce_0_takes_nccl ||
  bad multi_gpu_pipeline_ce_0_takes_nccl
grep -m1 "^done:" "$TMP/np_ddp.log"
# -- layer graphs on several processes (cuda_graphs=true; off by default there): each
# layer's recorded forward and backward replayed between the hooks (DDP's reductions, FSDP's
# gathers) and a pipeline's sends and receives must be bitwise the run op by op above
# (NAME|ITS RUN ABOVE|NP x KEYS)
while IFS='|' read -r name ref keys; do
  out=$TMP/graphs_$name
  runn "$out" $keys cuda_graphs=true
  d=$("$DIFF" "$TMP/$ref/ckpt.bin" "$out/ckpt.bin" 2>&1) rep=$(grep -m1 "^layer graphs:" "$out.log")
  if [ "$d" = "max_rel_diff 0" ] && [[ $rep =~ recorded,\ [1-9][0-9]*\ replayed ]]
  then ok "multi_gpu_layer_graphs_bitwise_$name (${rep%% (*})"
  else bad "multi_gpu_layer_graphs_bitwise_$name ($d; ${rep:-no graphs line}; $(tail -1 "$out.log"))"; fi
done <<CASES
ddp|np_ddp|$M tie_embeddings=false batch_size=$B
fsdp_tied|np_fsdp_tied|$M tie_embeddings=true batch_size=$B fsdp=true shard_strategy=full
pp_1f1b|pp_ce_1f1b|$M micro_batches=2 tie_embeddings=false batch_size=$((NP * B)) pipeline_parallel_size=$NP
pp_zb1_tied|pp_ce_zb1_tied|$M micro_batches=8 pipeline_schedule=zb1 tie_embeddings=true batch_size=$((NP * B)) pipeline_parallel_size=$NP
pp_interleaved|pp_ce_interleaved|${M/n_layers=2/n_layers=4} micro_batches=4 pipeline_schedule=interleaved tie_embeddings=true batch_size=$((NP * B)) pipeline_parallel_size=$NP
CASES
# -- DDP's all-reduce runs on the copy engines by default (one machine, NCCL 2.28+), also
# in pieces of a small all-to-all buffer (the test hook MESHTRAIN_CE_BUFFER_BYTES); with
# copy_engines=false (above) on NCCL's all-reduce kernels
grep -q "^gradient all-reduce: copy engines" "$TMP/np_ddp.log" && ok multi_gpu_ddp_on_copy_engines ||
  bad "multi_gpu_ddp_on_copy_engines ($(grep -m1 "^gradient all-reduce" "$TMP/np_ddp.log"))"
grep -q "^gradient all-reduce: NCCL all-reduce" "$TMP/np_ddp_nccl_allreduce.log" && ok multi_gpu_ddp_copy_engines_off ||
  bad multi_gpu_ddp_copy_engines_off
# -- the estimate counts the copy engines' all-to-all buffer only where DDP takes that path
# (comm_copy_engines_possible): it is larger with them, and within 5% of the measured peak
# both with and without them (the buffer alone is over 10% of this model's peak)
ec=$(logged estimate_bytes "$TMP/np_ddp") pc=$(logged gpu_peak_alloc_bytes "$TMP/np_ddp")
en=$(logged estimate_bytes "$TMP/np_ddp_nccl_allreduce") pn=$(logged gpu_peak_alloc_bytes "$TMP/np_ddp_nccl_allreduce")
echo "  copy engines: estimate $ec, peak $pc; NCCL all-reduce: estimate $en, peak $pn"
if within5 "$ec" "$pc" && within5 "$en" "$pn" && [ "$ec" -gt "$en" ]
then ok multi_gpu_estimate_counts_copy_engine_buffer
else bad multi_gpu_estimate_counts_copy_engine_buffer; fi
out=$TMP/np_ddp_pieces
if MESHTRAIN_CE_BUFFER_BYTES=100000 runn "$out" $M tie_embeddings=true batch_size=$B && close "$TMP/one_true" "$out"
then ok multi_gpu_ddp_copy_engines_in_pieces
else bad "multi_gpu_ddp_copy_engines_in_pieces ($(tail -3 "$out.log" | tr '\n' ' '))"; fi

TOL=2e-2
MM=${M/precision=fp32/precision=mixed}
run1 "$TMP/one_mixed" $MM tie_embeddings=true batch_size=$((NP * B))
for keys in "" "bucket_mb=0" "fsdp=true shard_strategy=full"; do
  out=$TMP/np_mixed_${keys//[ =]/_}
  if runn "$out" $MM tie_embeddings=true batch_size=$B $keys && close "$TMP/one_mixed" "$out"
  then ok "multi_gpu_mixed_follows_one_gpu ${keys:-ddp}"
  else bad "multi_gpu_mixed_follows_one_gpu ${keys:-ddp} ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done
# tensor parallel with bf16 activations through NCCL (sequence parallel on and off)
for keys in "" "sequence_parallel=false"; do
  out=$TMP/tp_mixed_${keys//[ =]/_}
  if runn "$out" $MM tie_embeddings=true batch_size=$((NP * B)) tensor_parallel_size=$NP $keys &&
     close "$TMP/one_mixed" "$out"
  then ok "multi_gpu_tp_mixed_follows_one_gpu ${keys:-sp}"
  else bad "multi_gpu_tp_mixed_follows_one_gpu ${keys:-sp} ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done

MB=${M/precision=fp32/precision=bf16}
run1 "$TMP/one_bf16" $MB tie_embeddings=true batch_size=$((NP * B))
for keys in "" "fsdp=true shard_strategy=grad_op" "fsdp=true shard_strategy=full"; do
  out=$TMP/np_bf16_${keys//[ =]/_}
  if runn "$out" $MB tie_embeddings=true batch_size=$B $keys && close "$TMP/one_bf16" "$out"
  then ok "multi_gpu_bf16_follows_one_gpu ${keys:-ddp}"
  else bad "multi_gpu_bf16_follows_one_gpu ${keys:-ddp} ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done
# tensor parallel with bf16 activations on NCCL's collectives too (the runs above: the
# default, fused at tp 2 and 4)
for keys in "" "sequence_parallel=false"; do
  out=$TMP/tp_coll_bf16_${keys//[ =]/_}
  if runn "$out" $MB tie_embeddings=true batch_size=$((NP * B)) tensor_parallel_size=$NP tp_comm=collectives $keys &&
     close "$TMP/one_bf16" "$out"
  then ok "multi_gpu_tp_collectives_bf16_follows_one_gpu ${keys:-sp}"
  else bad "multi_gpu_tp_collectives_bf16_follows_one_gpu ${keys:-sp} ($(tail -3 "$out.log" | tr '\n' ' '))"; fi
done

# -- without clipping DDP updates in two parts, first the part whose all-reduces are done
# (the head's and layer 3's; units 2..0 and the embedding rows are reduced at the end of
# the backward): the same parameters as the update in one part (a clip of 1e9 never bites)
for prec in mixed bf16; do
  MS="${M/precision=fp32/precision=$prec}"
  MS="${MS/n_layers=2/n_layers=4} bucket_mb=0 tie_embeddings=false batch_size=$B"
  runn "$TMP/split0_$prec" ${MS/grad_clip=1/grad_clip=0} && runn "$TMP/split1_$prec" ${MS/grad_clip=1/grad_clip=1e9}
  d=$("$DIFF" "$TMP/split0_$prec/ckpt.bin" "$TMP/split1_$prec/ckpt.bin" 2>&1)
  [ "$d" = "max_rel_diff 0" ] && ok "multi_gpu_ddp_update_in_two_parts_$prec" || bad "multi_gpu_ddp_update_in_two_parts_$prec ($d)"
done

# -- a rank that dies, or hangs, ends the whole job within seconds on GPUs too (NCCL
# collectives in flight), with a line naming it: DDP and FSDP
# fault NAME VAR COMM_TIMEOUT PATTERN KEYS...: rank 1 killed or hung at step 3 (VAR=1:3)
fault() {
  local name=$1 var=$2 ct=$3 pat=$4 t0 out rc t; shift 4
  t0=$(date +%s)
  out=$(env "$var=1:3" timeout 120 mpirun --allow-run-as-root --bind-to none --stdin none -np "$NP" \
        "$BIN" train ${M/steps=5/steps=50} batch_size=$B "$@" comm_timeout=$ct out_dir="$TMP/$name" 2>&1); rc=$?
  t=$(( $(date +%s) - t0 ))
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 60 ] && echo "$out" | grep -q "$pat" \
    && ok "$name (${t}s)" || bad "$name (exit $rc after ${t}s: $(tail -2 <<<"$out" | tr '\n' ' '))"
}
for keys in "" "fsdp=true"; do
  name=${keys:-ddp}; name=${name%%=*}
  fault "gpu_killed_rank_ends_job_$name" MESHTRAIN_FAULT_KILL 20 "rank 1.*signal 9" $keys
  fault "gpu_hung_rank_times_out_$name" MESHTRAIN_FAULT_HANG 5 "did not complete within 5 s" $keys
done
# ... and tensor parallel's fused sums, whose waits for a peer's rows are on the device: the
# host's tickets (within comm_timeout) still end the job
fault gpu_killed_rank_ends_job_tp_fused MESHTRAIN_FAULT_KILL 20 "rank 1.*signal 9" tensor_parallel_size=$NP tp_comm=fused
fault gpu_hung_rank_times_out_tp_fused MESHTRAIN_FAULT_HANG 5 "did not complete within 5 s" tensor_parallel_size=$NP tp_comm=fused
# ... and pipeline stages whose receives wait on the device (pp_copy_engines=true): the host
# still notices, at the receive R later or at the optimizer step
fault gpu_killed_stage_ends_job_pp_ce MESHTRAIN_FAULT_KILL 20 "rank 1.*signal 9" pipeline_parallel_size=$NP micro_batches=2 \
  pp_copy_engines=true
fault gpu_hung_stage_times_out_pp_ce MESHTRAIN_FAULT_HANG 5 "did not complete within 5 s" pipeline_parallel_size=$NP \
  micro_batches=2 pp_copy_engines=true

# -- offload=optimizer on NP GPUs: each rank's shard of the master weights and the
# optimizer's state in its pinned host memory, its update on the CPU cores: ZeRO-2 and FSDP
# follow the same NP-GPU run without offload over 20 steps (fp32 within 1e-5; mixed within
# the mixed tolerance: every loss within 3%, the mean under 1%), AdamW and Adafactor
O="${M/steps=5/steps=20} batch_size=$B"
# NAME|PRECISION|KEYS|OFFLOAD SETTINGS (besides none; default optimizer)
while IFS='|' read -r name prec keys offs; do
  a=$TMP/moff_${name}_none
  runn "$a" ${O/precision=fp32/precision=$prec} $keys offload=none
  for off in ${offs:-optimizer}; do
    b=$TMP/moff_${name}_$off
    runn "$b" ${O/precision=fp32/precision=$prec} $keys offload=$off
    if [ "$prec" = fp32 ]; then
      if (TOL=1e-5; close "$a" "$b"); then ok "multi_gpu_offload_${off}_follows_$name"
      else bad "multi_gpu_offload_${off}_follows_$name ($(tail -3 "$b.log" | tr '\n' ' '))"; fi
    elif paste <(losses "$a") <(losses "$b") |
         awk '{d=($1-$2)/$1; if(d<0)d=-d; s+=d; if(d>m)m=d; n++} END{printf "  offload mixed: max %.3g mean %.3g over %d steps\n", m, s/n, n;
              exit !(n == 20 && m < 0.03 && s/n < 0.01)}'
    then ok "multi_gpu_offload_${off}_follows_$name"; else bad "multi_gpu_offload_${off}_follows_$name ($(tail -3 "$b.log" | tr '\n' ' '))"; fi
  done
done <<'CASES'
zero2_fp32|fp32|fsdp=true shard_strategy=grad_op
fsdp_tied_fp32|fp32|fsdp=true shard_strategy=full tie_embeddings=true|optimizer params
fsdp_accum_fp32|fp32|fsdp=true grad_accum_steps=2|optimizer params
ddp_fp32|fp32|
adafactor_fsdp_fp32|fp32|fsdp=true optimizer=adafactor|optimizer params
zero2_mixed|mixed|fsdp=true shard_strategy=grad_op
fsdp_mixed|mixed|fsdp=true|optimizer params
CASES

echo "RESULT $pass $fail"
