#!/usr/bin/env bash
# Proves that the working tree trains bitwise as a reference commit does, on CPU ranks: for
# each strategy (one process, DDP, ZeRO-1/2, FSDP full, hybrid and padded, every pipeline
# schedule, tensor and sequence parallel, 3D meshes, gradient accumulation, optimizer and
# parameter offload, Adafactor, activation checkpointing, tied embeddings, resuming) the
# reference binary and this tree's run the same keys for 5 steps of a tiny model, and a case
# is "same" only when
#   - every step line of the log (loss, lr, grad_norm, as printed: 6 decimals) and the
#     validation loss are equal,
#   - the final checkpoints' parameters are bitwise equal (tests/ckpt_diff prints
#     "max_rel_diff 0"; this tree's, and the reference's where it can read this tree's file),
#   - and so is the whole training state (tests/ckpt_diff -s: parameters, AdamW's moments or
#     Adafactor's statistics, step, optimizer step, data-loader position, last loss as a
#     double); the rest of the checkpoint header (the settings) may differ.
# Both binaries' `prepare` must also write the same shards. It prints `same    CASE` or
# `DIFFERS CASE: what differs, at which step or tensor first`, then "N same, N differ";
# exit status 1 if any differ, 2 if it cannot run.
#
#   bench/same_as_commit.sh [COMMIT]            # COMMIT: default 61d78dd
#   CASES="ddp2 fsdp4" bench/same_as_commit.sh  # some cases only; CASES=list prints them
#   KEEP=1 bench/same_as_commit.sh              # keep every run's folder, not only those that differ
#                                               # (of which the first 3 keep their checkpoints)
#
# The reference is extracted once (`git archive COMMIT`) and built CPU-only (make NVCC=) into
# build-ref/<commit>/, kept for the next run; this tree is built CPU-only into build-same/
# (both ignored by git). Runs are serial with one thread per rank and mpirun oversubscribed as
# tests/lib.sh sets it up: about 5 minutes for the whole list on two busy cores. The checkpoints
# of both sides are read by this tree's ckpt_diff -s, which therefore must read the
# reference's files, as a resume from them does (resume_ref_zero1_2 resumes one).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
t_start=$(date +%s)

REF_ARG=${1:-61d78dd}
REF=$(git rev-parse --verify --quiet "$REF_ARG^{commit}") || { echo "same_as_commit: no commit $REF_ARG" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "same_as_commit: mpirun not found (make deps)" >&2; exit 2; }

# name|ranks|keys (beside M's, which they replace). batch_size is per data-parallel rank: 8
# sequences a step but in the accumulation cases. Clipping is on (grad_clip=1) except in the
# _noclip cases, which take DDP's update in two parts (the late units first, the others on the
# side queue) that only an unclipped step runs. "@" keys are this script's (run_side).
CASE_LIST='
single|1|batch_size=8
ddp2|2|batch_size=4
ddp4|4|batch_size=2
ddp2_noclip|2|batch_size=4 grad_clip=0
ddp2_tied|2|batch_size=4 tie_embeddings=true
zero1_2|2|batch_size=4 zero_opt=true
zero2_2|2|batch_size=4 fsdp=true shard_strategy=grad_op
fsdp2|2|batch_size=4 fsdp=true shard_strategy=full
fsdp4|4|batch_size=2 fsdp=true shard_strategy=full
hybrid4|4|batch_size=2 fsdp=true shard_strategy=hybrid shard_group_size=2
pp2_gpipe|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=gpipe
pp2_1f1b|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=1f1b
pp2_interleaved|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=interleaved
pp2_zb1|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=zb1
pp2_1f1b_tied|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=1f1b tie_embeddings=true
pp4_zb1|4|batch_size=8 pipeline_parallel_size=4 micro_batches=8 pipeline_schedule=zb1
pp4_interleaved|4|batch_size=8 n_layers=8 pipeline_parallel_size=4 micro_batches=8 pipeline_schedule=interleaved
pp2_zb1_head_tied|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=zb1 tie_embeddings=true pipeline_split=4,0
tp2|2|batch_size=8 tensor_parallel_size=2 sequence_parallel=true
tp2_nosp|2|batch_size=8 tensor_parallel_size=2 sequence_parallel=false
tp2_dp2|4|batch_size=4 tensor_parallel_size=2 fsdp=true
tp4|4|batch_size=8 tensor_parallel_size=4
tp4_nosp|4|batch_size=8 tensor_parallel_size=4 sequence_parallel=false
tp2_ac|2|batch_size=8 tensor_parallel_size=2 activation_checkpointing=true
accum3|1|batch_size=4 grad_accum_steps=3
accum3_ddp2|2|batch_size=2 grad_accum_steps=3
offload_opt|1|batch_size=8 offload=optimizer
offload_opt_ddp2|2|batch_size=4 offload=optimizer
offload_opt_fsdp2|2|batch_size=4 fsdp=true offload=optimizer
offload_params_fsdp2|2|batch_size=4 fsdp=true offload=params
adafactor|1|batch_size=8 optimizer=adafactor
adafactor_fsdp2|2|batch_size=4 fsdp=true optimizer=adafactor
ac|1|batch_size=8 activation_checkpointing=true
ac_pp2|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 activation_checkpointing=true
zero1_4|4|batch_size=2 zero_opt=true
zero2_4|4|batch_size=2 fsdp=true shard_strategy=grad_op
fsdp3_padded|3|batch_size=2 fsdp=true
ddp2_unit_buckets|2|batch_size=4 bucket_mb=0
fsdp2_no_overlap|2|batch_size=4 fsdp=true overlap=false
pp2_dp2_fsdp|4|batch_size=4 pipeline_parallel_size=2 micro_batches=2 fsdp=true
pp2_tp2|4|batch_size=8 pipeline_parallel_size=2 micro_batches=2 tensor_parallel_size=2
pp2_tp2_zb1|4|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=zb1 tensor_parallel_size=2
pp2_head_alone|2|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_split=4,0
pp2_accum2|2|batch_size=4 pipeline_parallel_size=2 micro_batches=2 grad_accum_steps=2
tp2_adafactor|2|batch_size=8 tensor_parallel_size=2 optimizer=adafactor
adafactor_beta1|1|batch_size=8 optimizer=adafactor adafactor_beta1=0.9
adafactor_zero1_2|2|batch_size=4 zero_opt=true optimizer=adafactor
resume_fsdp2|2|batch_size=4 fsdp=true @resume_at=3
single_noclip|1|batch_size=8 grad_clip=0
tp2_noclip|2|batch_size=8 tensor_parallel_size=2 sequence_parallel=true grad_clip=0
adafactor_ddp2|2|batch_size=4 optimizer=adafactor
adafactor_offload|1|batch_size=8 optimizer=adafactor offload=optimizer
adafactor_offload_fsdp2|2|batch_size=4 fsdp=true optimizer=adafactor offload=optimizer
adafactor_offload_tp2|2|batch_size=8 tensor_parallel_size=2 optimizer=adafactor offload=optimizer
offload_opt_noclip|1|batch_size=8 offload=optimizer grad_clip=0
offload_opt_zero1_2|2|batch_size=4 zero_opt=true offload=optimizer
offload_opt_zero2_2|2|batch_size=4 fsdp=true shard_strategy=grad_op offload=optimizer
offload_opt_tp2|2|batch_size=8 tensor_parallel_size=2 offload=optimizer
offload_opt_accum3|1|batch_size=4 grad_accum_steps=3 offload=optimizer
offload_params_hybrid4|4|batch_size=2 fsdp=true shard_strategy=hybrid shard_group_size=2 offload=params
resume_ref_zero1_2|2|batch_size=4 zero_opt=true @resume_at=3 @resume_from=ref
'
NAMES=$(awk -F'|' 'NF == 3 {print $1}' <<<"$CASE_LIST")
if [ "${CASES:-}" = list ]; then awk -F'|' 'NF == 3 {printf "%-22s np=%s  %s\n", $1, $2, $3}' <<<"$CASE_LIST"; exit 0; fi
WANT=$(echo ${CASES:-prepare $NAMES})  # one line, names between spaces
for c in $WANT; do
  [ "$c" = prepare ] || grep -qx "$c" <<<"$NAMES" ||
    { echo "same_as_commit: no case $c (cases: prepare" $NAMES")" >&2; exit 2; }
done

# -- builds: CPU-only (NVCC= leaves the CUDA backend out), each in its own BUILD folder
build() {  # DIR BUILD: meshtrain and tests/ckpt_diff of the tree at DIR, into DIR/BUILD
  mkdir -p "$1/$2"
  make -C "$1" -j2 --no-print-directory NVCC= BUILD="$2" "$2/meshtrain" "$2/tests/ckpt_diff" >"$1/$2/make.log" 2>&1 ||
    { echo "same_as_commit: the build in $1 failed: $(tail -3 "$1/$2/make.log")" >&2; exit 2; }
}
REF_TREE=$ROOT/build-ref/${REF:0:12}
if [ ! -f "$REF_TREE/Makefile" ]; then
  rm -rf "$REF_TREE.tmp" && mkdir -p "$REF_TREE.tmp" &&
    git archive "$REF" | tar -x -C "$REF_TREE.tmp" && mv "$REF_TREE.tmp" "$REF_TREE" ||
    { echo "same_as_commit: cannot extract $REF into $REF_TREE" >&2; exit 2; }
fi
build "$REF_TREE" build-cpu
build "$ROOT" build-same
REF_BIN=$REF_TREE/build-cpu/meshtrain REF_DIFF=$REF_TREE/build-cpu/tests/ckpt_diff
CUR_BIN=$ROOT/build-same/meshtrain CUR_DIFF=$ROOT/build-same/tests/ckpt_diff
t_built=$(date +%s)

# -- Open MPI as tests/lib.sh's use_mpirun sets it up (root in a container, more ranks than cores)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
MPIRUN="mpirun --oversubscribe --bind-to none --stdin none"

WORK=$(mktemp -d /tmp/same_as_commit.XXXXXX)
n_same=0; n_differ=0
same()    { n_same=$((n_same + 1)); echo "same    $1"; }
differs() { n_differ=$((n_differ + 1)); echo "DIFFERS $1: $2"; }

# -- data: both binaries prepare the same text (tests/lib.sh's prepare_data); the shards must
# be the same bytes, and every run then reads the reference's
[ -f data/tinystories/TinyStories-train.head-2MiB.txt ] || make --no-print-directory data >/dev/null ||
  { echo "same_as_commit: make data failed" >&2; exit 2; }
head -c 400000 data/tinystories/TinyStories-train.head-2MiB.txt >"$WORK/stories.txt"
for side in ref cur; do
  bin=$REF_BIN; [ $side = cur ] && bin=$CUR_BIN
  "$bin" prepare input="$WORK/stories.txt" data_dir="$WORK/data_$side" >"$WORK/prepare_$side.log" 2>&1 ||
    { echo "same_as_commit: $side prepare failed: $(tail -1 "$WORK/prepare_$side.log")" >&2; exit 2; }
done
if [[ " $WANT " == *" prepare "* ]]; then
  why=""
  for f in train.bin val.bin; do cmp -s "$WORK/data_ref/$f" "$WORK/data_cur/$f" || why="$why${why:+, }$f"; done
  [ -z "$why" ] && same prepare || differs prepare "the shards differ: $why"
fi
D=$WORK/data_ref
# the model and the schedule (a resumed run takes them from its checkpoint), and the run's keys
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=4 context_len=32 steps=5 lr=1e-3 lr_schedule=cosine warmup_steps=2
   grad_clip=1"
RUN="val_batches=1 progress=false threads=1 data_dir=$D"

# steps DIR: the log's step lines without the timings, and its validation loss lines
steps() { grep -E '^\{"step":[0-9]+,"(loss|val_loss)"' "$1/log.jsonl" 2>/dev/null | sed 's/,"ms".*//; s/}$//'; }
# first_field_diff A B: "step S: FIELD X against Y" for the first line and field where A and B part
first_field_diff() {
  paste -d '\n' <(echo "$1") <(echo "$2") | awk -F, '
    NR % 2 { a = $0; next }
    a != $0 { na = split(a, x, ","); split($0, y, ",")
              for (i = 1; i <= na; i++) if (x[i] != y[i]) break
              s = x[1]; sub(/.*:/, "", s); f = x[i]; sub(/:.*/, "", f); gsub(/[{"]/, "", f)
              va = x[i]; sub(/^[^:]*:/, "", va); vb = y[i]; sub(/^[^:]*:/, "", vb)
              printf "step %s: %s %s against %s\n", s, f, va, vb; exit }'
}

RUN_TIMEOUT=${RUN_TIMEOUT:-300}
# leg SIDE NP KEYS...: one `train` of SIDE's binary into $out/SIDE; its exit status (124: it
# ran past RUN_TIMEOUT seconds: a hang)
leg() {
  local side=$1 np=$2 bin=$REF_BIN launch=(); shift 2
  [ "$side" = cur ] && bin=$CUR_BIN
  [ "$np" = 1 ] || launch=($MPIRUN -np "$np")
  timeout -k 10 "$RUN_TIMEOUT" "${launch[@]}" "$bin" train "$@" $RUN out_dir="$out/$side" </dev/null \
    >>"$out/$side.log" 2>&1
}
# run_side SIDE NP KEYS: the case's runs of SIDE. KEYS may hold "@resume_at=S": S steps (the
# cosine still ending at step 5), then a resumed run to step 5 with the case's keys again;
# "@resume_from=ref" as well: this tree resumes the reference's step-S checkpoint, not its own.
run_side() {
  local side=$1 np=$2 k=$3 at="" from=""
  [[ " $k " =~ \ @resume_at=([0-9]+)\  ]] && at=${BASH_REMATCH[1]}
  [[ " $k " == *" @resume_from=ref "* ]] && from=ref
  k=$(sed 's/@[^ ]*//g' <<<"$k")
  if [ -z "$at" ]; then leg "$side" "$np" $(keys "$k"); return; fi
  if [ "$side" = cur ] && [ "$from" = ref ]; then cp -r "$out/ref_at_$at" "$out/cur" || return
  else leg "$side" "$np" $(keys "$k steps=$at lr_decay_steps=5") || return; fi
  [ "$side" = ref ] && cp -r "$out/ref" "$out/ref_at_$at"
  leg "$side" "$np" resume="$out/$side/ckpt.bin" steps=5 $k
}
# keys CASE_KEYS: M with the case's keys in place of M's of the same name (a key given twice is refused)
keys() {
  local k out=()
  for k in $M; do [[ " $1 " == *" ${k%%=*}="* ]] || out+=("$k"); done
  echo "${out[@]}" $1
}
# failure LOG: the line saying why a run failed (meshtrain's own, not mpirun's frame around it)
failure() { grep -m1 -E '^meshtrain|rror|signal|Abort' "$1" || tail -1 "$1"; }

while IFS='|' read -r name np case_keys; do
  [ -n "$name" ] && [[ " $WANT " == *" $name "* ]] || continue
  out=$WORK/$name; mkdir -p "$out"
  t0=$(date +%s.%N)
  run_side ref "$np" "$case_keys"; rc_ref=$?
  run_side cur "$np" "$case_keys"; rc_cur=$?
  why=(); note=""
  if [ $rc_ref -ne 0 ] || [ $rc_cur -ne 0 ]; then
    [ $rc_ref -ne 0 ] && why+=("the reference run failed (exit $rc_ref: $(failure "$out/ref.log"))")
    [ $rc_cur -ne 0 ] && why+=("this tree's run failed (exit $rc_cur: $(failure "$out/cur.log"))")
  else
    a=$(steps "$out/ref"); b=$(steps "$out/cur")
    if [ "$(grep -c '"loss"' <<<"$a")" -ne 5 ]; then why+=("the reference log has $(grep -c '"loss"' <<<"$a") step lines, not 5")
    elif [ "$a" != "$b" ]; then
      d=$(first_field_diff "$a" "$b")
      why+=("log ${d:-has $(grep -c . <<<"$b") lines against $(grep -c . <<<"$a")}")
    fi
    A=$out/ref/ckpt.bin B=$out/cur/ckpt.bin
    # this tree's ckpt_diff must read both; the reference's, where it reads this tree's file
    # (a later checkpoint version it may not), must agree
    p=$("$CUR_DIFF" "$A" "$B" 2>&1)
    [ "$p" = "max_rel_diff 0" ] ||
      why+=("parameters ($(tail -1 <<<"$p"); first: $("$CUR_DIFF" -v "$A" "$B" 2>&1 | head -1))")
    q=$("$REF_DIFF" "$A" "$B" 2>&1); rc=$?
    if [ $rc -ne 0 ]; then note=" (the reference's ckpt_diff cannot read it: $(tail -1 <<<"$q"))"
    elif [ "$q" != "$p" ]; then why+=("the two ckpt_diffs disagree (the reference's: $q)"); fi
    s=$("$CUR_DIFF" -s "$A" "$B" 2>&1)
    [ "$(tail -1 <<<"$s")" = "state_diff 0" ] ||
      why+=("training state ($(tail -1 <<<"$s"); first: $(head -1 <<<"$s"))")
  fi
  t=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  if [ ${#why[@]} -eq 0 ]; then
    same "$name$note"
    [ -n "${KEEP:-}" ] || rm -rf "$out"
  else
    msg=$(printf '%s; ' "${why[@]}"); differs "$name" "${msg%; } [runs in $out]"
    # (the first few keep their checkpoints, 160 MB a case; the others their logs)
    [ -n "${KEEP:-}" ] || [ $n_differ -le 3 ] || rm -f "$out"/*/ckpt.bin*
  fi
  echo "$name $np $t" >>"$WORK/times"
done <<<"$CASE_LIST"

t_end=$(date +%s)
echo "builds $((t_built - t_start)) s, runs $((t_end - t_built)) s (slowest: $(sort -k3 -g -r "$WORK/times" 2>/dev/null |
  head -3 | awk '{printf "%s%s %s s", (NR > 1 ? ", " : ""), $1, $3}'))"
echo "$n_same same, $n_differ differ"
if [ $n_differ -eq 0 ] && [ -z "${KEEP:-}" ]; then rm -rf "$WORK"; else echo "runs kept in $WORK"; fi
[ $n_differ -eq 0 ]
