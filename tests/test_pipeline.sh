#!/usr/bin/env bash
# Pipeline parallel on CPU ranks (mpirun): every schedule (gpipe, 1f1b, interleaved over 2
# and 4 virtual stages, zb1) at 2 and 4 stages with m = p, 2p and an odd m > p, tied and
# untied, and 2 stages x 2 DDP ranks, each following the
# single-process run of the same global batch; 2 stages x 2 data-parallel ranks with DDP,
# ZeRO-1, ZeRO-2, FSDP and hybrid FSDP, (losses within 1e-5 relative over 5 steps,
# final parameters within 1e-5); the same with a last stage holding the head alone
# (pipeline_split=...,0) under every schedule (cases marked ~ run only outside the sanitizer build); a checkpoint resumes across pipeline layouts
# (from and to a head-only stage too); grad_accum_steps beside the pipeline follows one
# process at the k times larger batch (every schedule, and with FSDP); zb1_max_in_flight
# changes zb1's lists and their estimate, not the arithmetic; bad layouts and bad values of
# the pipeline's keys are one line and exit 2; a killed stage ends the job. pp_copy_engines
# on CPU ranks changes nothing.
TEST_NAME=pp
source "$(dirname "$0")/lib.sh"
use_mpirun
command -v mpirun >/dev/null || skip_all "test_pipeline: no mpirun"
prepare_data 300000

M0="vocab_size=50257 embed_dim=32 n_heads=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D"
M="$M0 n_layers=4"
ref() {  # ref BATCH TIED [N_LAYERS]: the single-process run, made once
  local r=$TMP/ref_$1_$2_${3:-4}
  [ -e "$r/ckpt.bin" ] || "$BIN" train $M0 n_layers=${3:-4} batch_size=$1 tie_embeddings=$2 out_dir="$r" >/dev/null
  echo "$r"
}
while IFS='|' read -r sched p dp m batch tied keys; do
  skip_sanitized "$sched" && continue; sched=${sched#\~}
  name="${sched}_pp${p}$([ "$dp" -gt 1 ] && echo "_dp$dp")_m${m}$([ "$tied" = true ] && echo _tied)${keys:+_${keys// /_}}"
  nl=$(grep -o 'n_layers=[0-9]*' <<<"$keys" | cut -d= -f2); nl=${nl:-4}
  keys=$(sed 's/n_layers=[0-9]*//' <<<"$keys")
  r=$(ref $((batch * dp)) "$tied" "$nl")
  out=$TMP/$name
  if $MPIRUN -np $((p * dp)) "$BIN" train $M0 n_layers=$nl batch_size=$batch tie_embeddings=$tied pipeline_parallel_size=$p \
       micro_batches=$m pipeline_schedule=$sched $keys out_dir="$out" </dev/null >"$out.log" 2>&1 && follows "$r" "$out"
  then ok "$name"; else bad "$name ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
~1f1b|2|1|2|8|false
~1f1b|2|1|4|8|false
1f1b|2|1|3|6|false
1f1b|2|1|4|8|true
~gpipe|2|1|2|8|false
gpipe|2|1|4|8|true
~gpipe|2|1|3|6|false
~1f1b|4|1|4|8|false
1f1b|4|1|8|8|true
~1f1b|4|1|5|5|false
~gpipe|4|1|4|8|true
~gpipe|4|1|8|8|false
~gpipe|4|1|5|5|false
~interleaved|2|1|2|8|false
~interleaved|2|1|4|8|true
interleaved|2|1|3|6|false
interleaved|4|1|4|8|true|n_layers=8
~interleaved|4|1|8|16|false|n_layers=8
~interleaved|4|1|5|5|false|n_layers=8
interleaved|2|1|4|8|false|n_layers=8 virtual_stages=4
~zb1|2|1|2|8|false
zb1|2|1|4|8|true
~zb1|2|1|3|6|false
~zb1|4|1|4|8|false
~zb1|4|1|8|8|true
zb1|4|1|5|5|false
~1f1b|2|2|2|4|false|
1f1b|2|2|2|4|true|
interleaved|2|2|2|4|true|fsdp=true
zb1|2|2|2|4|true|fsdp=true shard_strategy=grad_op
~zb1|2|2|2|4|false|
1f1b|2|2|2|4|false|zero_opt=true
~1f1b|2|2|2|4|true|fsdp=true shard_strategy=grad_op
~gpipe|2|2|2|4|false|fsdp=true
~1f1b|2|2|4|4|true|fsdp=true
1f1b|2|2|2|4|true|fsdp=true shard_strategy=hybrid shard_group_size=1
~1f1b|2|1|4|8|false|pipeline_split=4,0
1f1b|2|1|4|8|true|pipeline_split=4,0
gpipe|2|1|4|8|false|pipeline_split=4,0
~gpipe|2|1|4|8|true|pipeline_split=4,0
~zb1|2|1|4|8|false|pipeline_split=4,0
~zb1|2|1|4|8|true|pipeline_split=4,0
interleaved|2|1|4|8|true|pipeline_split=2,1,1,0
~interleaved|4|1|4|8|false|n_layers=8 pipeline_split=2,1,1,1,1,1,1,0
~interleaved|4|1|4|8|true|n_layers=8 pipeline_split=2,1,1,1,1,1,1,0
~zb1|4|1|4|8|true|pipeline_split=2,1,1,0
1f1b|2|2|2|4|true|fsdp=true pipeline_split=4,0
zb1|2|2|2|4|false|fsdp=true shard_strategy=grad_op pipeline_split=4,0
CASES
# gradient accumulation beside the pipeline: grad_accum_steps=k makes the step's schedule k x m
# micro-batches long, the update of a batch k times larger (the reference: one process at
# batch x dp x k)
while IFS='|' read -r sched p dp m batch k tied keys; do
  skip_sanitized "$sched" && continue; sched=${sched#\~}
  name="accum_${sched}_pp${p}$([ "$dp" -gt 1 ] && echo "_dp$dp")_m${m}_k${k}$([ "$tied" = true ] && echo _tied)${keys:+_${keys// /_}}"
  r=$(ref $((batch * dp * k)) "$tied")
  out=$TMP/$name
  if $MPIRUN -np $((p * dp)) "$BIN" train $M batch_size=$batch tie_embeddings=$tied pipeline_parallel_size=$p \
       micro_batches=$m grad_accum_steps=$k pipeline_schedule=$sched $keys out_dir="$out" </dev/null >"$out.log" 2>&1 &&
     grep -q "micro-batches of" "$out.log" && follows "$r" "$out"
  then ok "$name"; else bad "$name ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
1f1b|2|1|2|4|2|false
~gpipe|2|1|2|4|3|true
zb1|2|1|2|4|2|true
~interleaved|2|1|2|4|2|false
1f1b|2|2|2|2|2|false|fsdp=true
CASES

if [ -z "${MESHTRAIN_SANITIZED:-}" ]; then  # the plain build: arithmetic and headers; these layouts run sanitized above
# zb1_max_in_flight raises how many micro-batches a zb1 rank holds: other lists (stage 0's
# estimate grows with the buffers they need), the same arithmetic: it still follows one process
for h in 5 7; do
  $MPIRUN -np 4 "$BIN" train $M batch_size=8 pipeline_parallel_size=4 micro_batches=8 pipeline_schedule=zb1 \
    zb1_max_in_flight=$h out_dir="$TMP/zb1_held$h" </dev/null >"$TMP/zb1_held$h.log" 2>&1
done
e5=$(grep -o "^pipeline stage 0: .*estimate [0-9.]* [KMG]iB" "$TMP/zb1_held5.log" | grep -o "estimate .*")
e7=$(grep -o "^pipeline stage 0: .*estimate [0-9.]* [KMG]iB" "$TMP/zb1_held7.log" | grep -o "estimate .*")
if follows "$(ref 8 false)" "$TMP/zb1_held7" && [ -n "$e5" ] && [ -n "$e7" ] && [ "$e5" != "$e7" ]
then ok "zb1_held_7_follows ($e5 -> $e7)"; else bad "zb1_held_7_follows ($e5 -> $e7; $(tail -2 "$TMP/zb1_held7.log" | tr '\n' ' '))"; fi
fi

# cuda_graphs=true under zb1 (pp 2, the stage of 4 layers): every layer's forward and both
# halves of its split backward go through the recordings' cache (src/model/layer_graphs.c;
# on CPU ranks, which record nothing, op by op: 4 steps x 4 micro-batches x 4 layers x 3),
# bitwise the run without it (the GPU's replays: tests/gpu/test_multi_gpu.sh)
for gr in false true; do
  $MPIRUN -np 2 "$BIN" train $M batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=zb1 \
    cuda_graphs=$gr out_dir="$TMP/zb1_graphs_$gr" </dev/null >"$TMP/zb1_graphs_$gr.log" 2>&1
done
if cmp -s "$TMP/zb1_graphs_false/ckpt.bin" "$TMP/zb1_graphs_true/ckpt.bin" &&
   grep -q "^layer graphs: 0 recorded, 0 replayed, 192 layer calls op by op" "$TMP/zb1_graphs_true.log" &&
   ! grep -q "^layer graphs" "$TMP/zb1_graphs_false.log"
then ok zb1_graphs_cache_bitwise
else bad "zb1_graphs_cache_bitwise ($(grep "^layer graphs" "$TMP/zb1_graphs_true.log"); $(tail -1 "$TMP/zb1_graphs_true.log"))"; fi

if [ -z "${MESHTRAIN_SANITIZED:-}" ]; then  # the plain build: arithmetic and headers; these layouts run sanitized above
# the schedules order the same arithmetic differently: 1f1b, interleaved and zb1 (whose
# weight pass adds the same products in the same order, under any zb1_max_in_flight) end
# with the same bits
for sched in 1f1b interleaved zb1 zb1:2; do
  keys=; [[ $sched == *:* ]] && keys="zb1_max_in_flight=${sched#*:}"
  $MPIRUN -np 4 "$BIN" train $M0 n_layers=8 batch_size=8 pipeline_parallel_size=4 micro_batches=8 \
    pipeline_schedule=${sched%:*} $keys out_dir="$TMP/same_$sched" >"$TMP/same_$sched.log" 2>&1
done
d1=$("$DIFF" "$TMP/same_1f1b/ckpt.bin" "$TMP/same_interleaved/ckpt.bin" 2>&1)
d2=$("$DIFF" "$TMP/same_1f1b/ckpt.bin" "$TMP/same_zb1/ckpt.bin" 2>&1)
d3=$("$DIFF" "$TMP/same_1f1b/ckpt.bin" "$TMP/same_zb1:2/ckpt.bin" 2>&1)
[ "$d1" = "max_rel_diff 0" ] && [ "$d2" = "max_rel_diff 0" ] && [ "$d3" = "max_rel_diff 0" ] && ok schedules_agree_bitwise ||
  bad "schedules_agree_bitwise (interleaved: $d1; zb1: $d2; zb1 holding 2: $d3)"
fi

if [ -z "${MESHTRAIN_SANITIZED:-}" ]; then  # the plain build: arithmetic and headers; these layouts run sanitized above
# pp_copy_engines (true, the default: send/receive on the GPUs' copy engines) takes GPUs: on
# CPU ranks the links stay on MPI either way, the header says so, and the runs are bitwise
# the same
for v in false true; do
  $MPIRUN -np 2 "$BIN" train $M batch_size=8 pipeline_parallel_size=2 micro_batches=4 pp_copy_engines=$v \
    out_dir="$TMP/pp_ce_$v" </dev/null >"$TMP/pp_ce_$v.log" 2>&1
done
d=$("$DIFF" "$TMP/pp_ce_false/ckpt.bin" "$TMP/pp_ce_true/ckpt.bin" 2>&1)
[ "$d" = "max_rel_diff 0" ] && grep -q "^pipeline send/receive: MPI (host memory)" "$TMP/pp_ce_true.log" &&
  grep -q "^pipeline send/receive: MPI (host memory)" "$TMP/pp_ce_false.log" && ok pp_ce_on_cpu_ranks_stays_on_mpi ||
  bad "pp_ce_on_cpu_ranks_stays_on_mpi ($d; $(grep '^pipeline send' "$TMP/pp_ce_true.log"; tail -2 "$TMP/pp_ce_true.log" | tr '\n' ' '))"
fi

# the header names each stage's layers; an explicit split is taken as given
o=$($MPIRUN -np 2 "$BIN" train $M batch_size=8 pipeline_parallel_size=2 micro_batches=2 pipeline_split=3,1 \
    out_dir="$TMP/split" 2>&1)
grep -q "stage 0: embedding, layers 0-2; stage 1: layers 3-3, head" <<<"$o" && follows "$(ref 8 false)" "$TMP/split" &&
  ok explicit_split || bad "explicit_split ($(grep pipeline: <<<"$o"))"
# ... and a last 0: the last stage holds the head alone
grep -q "stage 0: embedding, layers 0-3; stage 1: head" "$TMP/1f1b_pp2_m4_tied_pipeline_split=4,0.log" &&
  ok header_head_alone || bad "header_head_alone ($(grep pipeline: "$TMP/1f1b_pp2_m4_tied_pipeline_split=4,0.log"))"

# resume across layouts: 2 stages for 3 steps, then one process to step 5; and one process
# for 3 steps, then 4 stages to step 5: both follow the straight run
R3=${M/steps=5/steps=3}
$MPIRUN -np 2 "$BIN" train $R3 batch_size=8 pipeline_parallel_size=2 micro_batches=2 out_dir="$TMP/res_a" >/dev/null 2>&1
"$BIN" train resume="$TMP/res_a/ckpt.bin" steps=5 data_dir="$D" progress=false threads=1 out_dir="$TMP/res_a" >/dev/null
follows "$(ref 8 false)" "$TMP/res_a" && ok resume_pp2_on_one_process || bad resume_pp2_on_one_process
"$BIN" train $R3 batch_size=8 tie_embeddings=true out_dir="$TMP/res_b" >/dev/null
$MPIRUN -np 4 "$BIN" train resume="$TMP/res_b/ckpt.bin" steps=5 data_dir="$D" progress=false threads=1 \
  pipeline_parallel_size=4 micro_batches=4 out_dir="$TMP/res_b" >/dev/null 2>&1
follows "$(ref 8 true)" "$TMP/res_b" && ok resume_one_process_on_pp4_tied || bad resume_one_process_on_pp4_tied
# ... from a stage holding the head alone (it saves the head, tied: not the embedding's copy)
# to one process, and from one process to such a stage
$MPIRUN -np 2 "$BIN" train $R3 batch_size=8 tie_embeddings=true pipeline_parallel_size=2 micro_batches=2 \
  pipeline_split=4,0 out_dir="$TMP/res_c" >/dev/null 2>&1
"$BIN" train resume="$TMP/res_c/ckpt.bin" steps=5 data_dir="$D" progress=false threads=1 out_dir="$TMP/res_c" >/dev/null
follows "$(ref 8 true)" "$TMP/res_c" && ok resume_head_alone_on_one_process_tied || bad resume_head_alone_on_one_process_tied
"$BIN" train $R3 batch_size=8 out_dir="$TMP/res_d" >/dev/null
$MPIRUN -np 4 "$BIN" train resume="$TMP/res_d/ckpt.bin" steps=5 data_dir="$D" progress=false threads=1 \
  pipeline_parallel_size=4 micro_batches=4 pipeline_schedule=zb1 pipeline_split=2,1,1,0 out_dir="$TMP/res_d" >/dev/null 2>&1
follows "$(ref 8 false)" "$TMP/res_d" && ok resume_one_process_on_head_alone || bad resume_one_process_on_head_alone

# bad layouts: one line from the job, exit 2, at start-up
while IFS='|' read -r np keys pat; do
  err=$($MPIRUN -np "$np" "$BIN" train $M batch_size=8 $keys 2>&1 >/dev/null); rc=$?
  n=$(grep -c '^meshtrain:' <<<"$err")
  [ $rc -ne 0 ] && [ "$n" -eq 1 ] && grep -qE "$pat" <<<"$err" && ok "refused: $keys" || bad "refused: $keys (exit $rc: $err)"
done <<'CASES'
2|pipeline_parallel_size=2 micro_batches=1|micro_batches=1 is fewer than pipeline_parallel_size=2
2|pipeline_parallel_size=2 micro_batches=3|micro_batches=3 does not divide batch_size=8
8|pipeline_parallel_size=8 micro_batches=8|pipeline_parallel_size=8 exceeds n_layers=4
2|pipeline_parallel_size=2 micro_batches=2 pipeline_split=0,4|pipeline_split=0,4: stage 0 holds no layer; only the last
4|pipeline_parallel_size=4 micro_batches=4 pipeline_split=2,0,2,0|pipeline_split=2,0,2,0: stage 1 holds no layer
2|pipeline_parallel_size=2 micro_batches=2 pipeline_split=2,1|pipeline_split=2,1: 2 counts summing to 3
3|pipeline_parallel_size=2 micro_batches=2|world size 3 is not divisible
4|pipeline_parallel_size=4 micro_batches=4 pipeline_schedule=interleaved|x virtual_stages=2 = 8 stages exceeds n_layers=4
2|pipeline_parallel_size=2 micro_batches=2 virtual_stages=2|virtual_stages=2 applies with pipeline_schedule=interleaved
2|pipeline_parallel_size=2 micro_batches=2 pipeline_schedule=interleaved virtual_stages=1|needs virtual_stages >= 2
2|pipeline_parallel_size=2 micro_batches=2 pipeline_schedule=zb1 activation_checkpointing=true|does not combine with activation_checkpointing
2|pipeline_parallel_size=2 micro_batches=2 zb1_max_in_flight=3|zb1_max_in_flight applies with pipeline_schedule=zb1, not pipeline_schedule=1f1b
2|pipeline_parallel_size=2 micro_batches=2 pipeline_schedule=zb1 zb1_max_in_flight=-1|zb1_max_in_flight=-1: out of range
2|pipeline_parallel_size=2 micro_batches=2 pipeline_schedule=zb1 zb1_max_in_flight=two|zb1_max_in_flight=two: not an integer
2|pipeline_parallel_size=2 micro_batches=2 pp_copy_engines=yes|pp_copy_engines=yes: expected true or false
1|pp_copy_engines=false|pp_copy_engines applies with pipeline_parallel_size > 1
CASES

# each stage's peak memory (max RSS) within 10% of its own estimate, under every schedule
# (GPipe's first stage holds every micro-batch, 1F1B's p - s, interleaved's per chunk,
# zb1's also its weight passes' inputs), and `meshtrain estimate`
# prints the same per-stage totals (within 2%: the run's also counts its mapped data)
if [ -z "${MESHTRAIN_SANITIZED:-}" ]; then  # ASan's shadow memory: RSS is no measure of the plan
  EM="vocab_size=50257 embed_dim=128 n_heads=4 n_layers=4 context_len=64"
  E="$EM steps=2 progress=false threads=1 val_batches=1 data_dir=$D"
  # (and a last stage holding the head alone: its activations hold no layer's; zb1/2: zb1
  # with zb1_max_in_flight=2, whose first stage holds 2 micro-batches, not 4)
  for sched in 1f1b gpipe interleaved zb1 zb1/2 1f1b:4,0 gpipe:4,0 interleaved:2,1,1,0; do
    split=auto; [[ $sched == *:* ]] && split=${sched#*:} sched=${sched%%:*}
    held=; [[ $sched == */* ]] && held=${sched#*/} sched=${sched%/*}
    o=$($MPIRUN -np 2 "$BIN" train $E batch_size=16 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=$sched \
        pipeline_split=$split ${held:+zb1_max_in_flight=$held} out_dir="$TMP/mem_$sched$held" 2>&1)
    est=$("$BIN" estimate $EM batch_size=16 world_size=2 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=$sched \
          pipeline_split=$split ${held:+zb1_max_in_flight=$held} 2>&1)
    good=1
    for s in 0 1; do
      line=$(grep "^pipeline stage $s: peak memory" <<<"$o")
      peak=$(awk '{print $6, $7}' <<<"$line") run_est=$(grep -o 'estimate [0-9.]* [KMG]iB' <<<"$line" | cut -d' ' -f2-)
      cli=$(grep "^  stage $s " <<<"$est" | grep -o 'total [0-9.]* [KMG]iB' | cut -d' ' -f2-)
      awk -v a="$peak" -v b="$run_est" -v c="$cli" 'function bytes(x, p) {split(x, p, " ");
          return p[1] * (p[2] == "KiB" ? 1024 : p[2] == "MiB" ? 1048576 : 1073741824)}
        BEGIN {r = bytes(a); e = bytes(b); d = (e - r) / r; if (d < 0) d = -d; x = (bytes(c) - e) / e; if (x < 0) x = -x
               exit !(r > 0 && d < 0.10 && x < 0.02)}' || good=0
    done
    [ $split = auto ] && split= || split=_$split
    [ -n "$held" ] && { split=_held$held$split; grep -q "^  stage 0 .*(2 micro-batches in flight)" <<<"$est" || good=0; }
    [ $good = 1 ] && ok "stage_memory_within_10pct_$sched$split" || bad "stage_memory_within_10pct_$sched$split ($(grep '^pipeline stage' <<<"$o" | tr '\n' ' '); cli: $(grep '^  stage' <<<"$est" | tr '\n' ' '))"
  done
fi

# a stage that dies ends the job within seconds
t0=$SECONDS
out=$(MESHTRAIN_FAULT_KILL=1:3 timeout 60 $MPIRUN -np 2 "$BIN" train ${M/steps=5/steps=50} batch_size=8 \
      pipeline_parallel_size=2 micro_batches=2 out_dir="$TMP/kill" 2>&1); rc=$?
t=$((SECONDS - t0))
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 30 ] && grep -q "rank 1.*signal 9" <<<"$out" &&
  ok "killed_stage_ends_job (${t}s)" || bad "killed_stage_ends_job (exit $rc after ${t}s)"
# ... and so does one that hangs: the stage waiting on it gives up after comm_timeout
t0=$SECONDS
out=$(MESHTRAIN_FAULT_HANG=1:3 timeout 60 $MPIRUN -np 2 "$BIN" train ${M/steps=5/steps=50} batch_size=8 \
      pipeline_parallel_size=2 micro_batches=2 comm_timeout=3 out_dir="$TMP/hang" 2>&1); rc=$?
t=$((SECONDS - t0))
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $t -lt 30 ] && grep -q "did not complete within 3 s" <<<"$out" &&
  ok "hung_stage_times_out (${t}s)" || bad "hung_stage_times_out (exit $rc after ${t}s: $(grep meshtrain: <<<"$out" | head -2))"
echo "RESULT $pass $fail"
