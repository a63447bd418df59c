#!/usr/bin/env bash
# offload=optimizer on CPU ranks: the master weights and the optimizer's state in "host"
# memory (on the cpu backend, other buffers of the same memory, moved through the ops'
# copy calls), the update on a worker thread, unit by unit. The same code as on a GPU runs,
# so every run follows the same run without offload bitwise: the losses, and the
# checkpoints byte for byte (AdamW and Adafactor, one process, DDP, ZeRO-1, ZeRO-2 and FSDP
# on 2 ranks, gradient accumulation, clipping on and off, tied embeddings, 2 pipeline
# stages, 2 tensor-parallel ranks (AdamW and Adafactor); offload=params with FSDP and hybrid
# FSDP). Clipping uses the global norm, computed on the device before any update starts; a
# clip that bites (0.05) is the case that shows it. Resume from an offloaded checkpoint is bitwise, and
# resumes without offload too (the checkpoint is the same file). Bad input: one line, exit 2.
# DDP with AdamW is lean (the host's master the only fp32 copy; the init, checkpoints and loads
# go through it): in fp32 its gradients go out as they are, and MESHTRAIN_OFFLOAD_STAGING=1
# sends them through the device staging buffers that carry bf16 gradients under
# precision=mixed (which the cpu backend has not: its rounding is checked in test_optim and on
# a GPU by bench/gpu_offload_7b.sh's sanity run).
TEST_NAME=offload
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 400000

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 progress=false threads=1 val_batches=1 data_dir=$D"
strip() { grep '^{"step":[0-9]*,"loss"' "$1/log.jsonl" | sed 's/,"ms".*//'; }
# same A B: the same losses and norms (every step), and the same checkpoint files
same() {
  local f
  [ -n "$(strip "$1")" ] && [ "$(strip "$1")" = "$(strip "$2")" ] || return 1
  for f in "$1"/ckpt.bin "$1"/ckpt.bin.s*.r*; do cmp -s "$f" "$2/${f##*/}" || return 1; done  # (not the settings)
}
# NAME|RANKS|BATCH_SIZE (per rank)|GRAD_CLIP|KEYS|OFFLOAD SETTINGS (besides none; default optimizer)
# KEYS may start with NAME=VALUE words: the environment of the offloaded runs (test hooks).
# ~NAME: not in the sanitized build (a near twin of a case that is, for CI's 30 minutes)
while IFS='|' read -r name np bs clip keys offs; do
  skip_sanitized "$name" && continue; name=${name#\~}
  if [ "$np" = 1 ]; then run=("$BIN"); else run=($MPIRUN -np "$np" "$BIN"); fi
  envs=(); read -ra kw <<<"$keys"
  while [ "${#kw[@]}" -gt 0 ] && [[ ${kw[0]} == MESHTRAIN_* ]]; do envs+=("${kw[0]}"); kw=("${kw[@]:1}"); done
  keys="${kw[*]}"
  for off in none ${offs:-optimizer}; do
    pre=(env); [ "$off" = none ] || pre+=("${envs[@]}")
    "${pre[@]}" "${run[@]}" train $M batch_size=$bs grad_clip=$clip $keys offload=$off out_dir="$TMP/${name}_$off" </dev/null \
      >"$TMP/${name}_$off.log" 2>&1
    [ "$off" = none ] && continue
    if same "$TMP/${name}_none" "$TMP/${name}_$off"; then ok "offload_${off}_follows_bitwise_$name"
    else bad "offload_${off}_follows_bitwise_$name ($(tail -1 "$TMP/${name}_$off.log"))"; fi
  done
done <<'CASES'
one|1|8|1|
~one_noclip|1|8|0|
one_clip_bites|1|8|0.05|
one_accum|1|4|1|grad_accum_steps=2
one_tied_recompute|1|8|1|tie_embeddings=true activation_checkpointing=true
one_staging_accum|1|4|1|MESHTRAIN_OFFLOAD_STAGING=1 grad_accum_steps=2 tie_embeddings=true
ddp_np2_staging|2|4|0.05|MESHTRAIN_OFFLOAD_STAGING=1
ddp_np2|2|4|1|
zero1_np2|2|4|1|zero_opt=true
zero2_np2|2|4|1|fsdp=true shard_strategy=grad_op
fsdp_one|1|8|1|fsdp=true|params
fsdp_np2|2|4|1|fsdp=true|optimizer params
fsdp_np2_tied_accum|2|2|1|fsdp=true tie_embeddings=true grad_accum_steps=2|optimizer params
hybrid_np4|4|2|1|fsdp=true shard_strategy=hybrid shard_group_size=2|params
~zero2_np2_accum_noclip|2|2|0|fsdp=true shard_strategy=grad_op grad_accum_steps=2
pipeline_np2_tied|2|8|1|pipeline_parallel_size=2 micro_batches=2 tie_embeddings=true
tp_np2|2|8|1|tensor_parallel_size=2
~tp_nosp_np2|2|8|1|tensor_parallel_size=2 sequence_parallel=false
tp_zero2_np4|4|4|1|tensor_parallel_size=2 fsdp=true shard_strategy=grad_op
adafactor_one|1|8|1|optimizer=adafactor adafactor_beta1=0.9
adafactor_zero2_np2|2|4|1|optimizer=adafactor fsdp=true shard_strategy=grad_op
adafactor_fsdp_np2|2|4|1|optimizer=adafactor fsdp=true adafactor_beta1=0.9|optimizer params
~adafactor_ddp_np2|2|4|1|optimizer=adafactor
adafactor_tp_np2|2|8|1|optimizer=adafactor tensor_parallel_size=2 adafactor_beta1=0.9
adafactor_tp_zero2_np4|4|4|1|optimizer=adafactor tensor_parallel_size=2 fsdp=true shard_strategy=grad_op
CASES
# the bite: clip 0.05 is below every step's norm (else the case shows nothing)
awk -F'"grad_norm":' 'NF > 1 {split($2, a, ","); if (a[1] + 0 <= 0.05) low = 1; n++} END {exit !(n == 5 && !low)}' \
  "$TMP/one_clip_bites_optimizer/log.jsonl" && ok offload_clip_case_clips || bad offload_clip_case_clips
grep -q "offloaded state" "$TMP/one_optimizer.log" && ok offload_estimate_in_header || bad offload_estimate_in_header

# -- resume: a run cut after its step-3 checkpoint (a NaN at step 4), resumed with offload
# to step 6, is bitwise the straight run without offload; and an offloaded checkpoint
# resumes without offload (one process, and 2 FSDP ranks)
R="${M/steps=5/steps=6} grad_clip=1"
resumes() {  # resumes NAME NP KEYS_CUT -- KEYS_RESUME: OUT=$TMP/NAME_resume
  local name=$1 np=$2 run cut=() res=(); shift 2
  while [ "$1" != -- ]; do cut+=("$1"); shift; done; shift; res=("$@")
  if [ "$np" = 1 ]; then run=("$BIN"); else run=($MPIRUN -np "$np" "$BIN"); fi
  "${run[@]}" train $R batch_size=$((4 / np)) "${cut[@]}" out_dir="$TMP/${name}_straight" </dev/null >/dev/null 2>&1
  MESHTRAIN_FAULT_NAN_STEP=4 "${run[@]}" train $R batch_size=$((4 / np)) "${cut[@]}" ckpt_every=3 \
    out_dir="$TMP/${name}_cut" </dev/null >/dev/null 2>&1
  OUT=$TMP/${name}_resume
  mkdir -p "$OUT"; cp "$TMP/${name}_cut"/ckpt.bin* "$OUT/"
  "${run[@]}" train resume="$OUT/ckpt.bin" batch_size=$((4 / np)) "${res[@]}" out_dir="$OUT" data_dir="$D" progress=false \
    threads=1 </dev/null >"$OUT.log" 2>&1
}
tail3() { strip "$1" | grep '^{"step":[4-6],'; }
resume_ok() {  # resume_ok NAME: steps 4-6 and the final checkpoint are the straight run's
  [ "$(tail3 "$TMP/$1_straight" | wc -l)" -eq 3 ] && [ "$(tail3 "$TMP/$1_straight")" = "$(tail3 "$TMP/$1_resume")" ] &&
    for f in "$TMP/$1_straight"/ckpt.bin "$TMP/$1_straight"/ckpt.bin.s*.r*; do cmp -s "$f" "$TMP/$1_resume/${f##*/}" || return 1; done
}
resumes plain 1 -- offload=optimizer
resume_ok plain && ok offload_resumes_plain_checkpoint_bitwise || bad "offload_resumes_plain_checkpoint_bitwise ($(tail -1 "$OUT.log"))"
resumes off 1 offload=optimizer -- offload=optimizer
resume_ok off && ok offload_resume_bitwise || bad "offload_resume_bitwise ($(tail -1 "$OUT.log"))"
resumes offplain 1 offload=optimizer --
resume_ok offplain && ok offload_checkpoint_resumes_without_offload || bad "offload_checkpoint_resumes_without_offload ($(tail -1 "$OUT.log"))"
# lean DDP over 2 ranks, gradients through the staging buffers (the bf16 path's code, in fp32)
MESHTRAIN_OFFLOAD_STAGING=1 resumes staging 2 offload=optimizer -- offload=optimizer
resume_ok staging && ok offload_resume_ddp_np2_staging_bitwise || bad "offload_resume_ddp_np2_staging_bitwise ($(tail -1 "$OUT.log"))"
resumes fsdp 2 fsdp=true offload=optimizer -- fsdp=true offload=optimizer
resume_ok fsdp && ok offload_resume_fsdp_np2_bitwise || bad "offload_resume_fsdp_np2_bitwise ($(tail -1 "$OUT.log"))"
resumes params 2 fsdp=true offload=params -- fsdp=true offload=params
resume_ok params && ok offload_params_resume_fsdp_np2_bitwise || bad "offload_params_resume_fsdp_np2_bitwise ($(tail -1 "$OUT.log"))"
resumes params_to_none 2 fsdp=true offload=params -- fsdp=true
resume_ok params_to_none && ok offload_params_checkpoint_resumes_without_offload ||
  bad "offload_params_checkpoint_resumes_without_offload ($(tail -1 "$OUT.log"))"
resumes af 1 optimizer=adafactor adafactor_beta1=0.9 offload=optimizer -- offload=optimizer
resume_ok af && ok offload_resume_adafactor_bitwise || bad "offload_resume_adafactor_bitwise ($(tail -1 "$OUT.log"))"
# the straight offloaded runs' checkpoints are the plain ones, byte for byte
cmp -s "$TMP/plain_straight/ckpt.bin" "$TMP/off_straight/ckpt.bin" && ok offload_checkpoint_is_the_plain_one ||
  bad offload_checkpoint_is_the_plain_one

# -- bad input, before anything runs
expect_exit 2 "offload=disk: expected one of none\|optimizer\|params" unknown_offload -- "$BIN" train offload=disk
expect_exit 2 "offload=params needs fsdp=true" offload_params_needs_fsdp -- "$BIN" train offload=params data_dir="$D"
expect_exit 2 "offload=params needs fsdp=true with shard_strategy=full" offload_params_refuses_zero2 -- \
  "$BIN" train offload=params fsdp=true shard_strategy=grad_op data_dir="$D"
expect_exit 2 "offload=optimizer keeps fp32 master weights, which precision=bf16" offload_refuses_bf16 -- \
  "$BIN" estimate offload=optimizer precision=bf16 device=cuda
MESHTRAIN_FAKE_MEMAVAILABLE=20000000 expect_exit 2 "offload=optimizer keeps about .* in host memory on this machine .* but only" \
  offload_host_memory_too_small -- "$BIN" train $M batch_size=8 offload=optimizer out_dir="$TMP/small"
[ ! -e "$TMP/small/ckpt.bin" ] && ok offload_host_check_before_training || bad offload_host_check_before_training
# a refused host (pinned) allocation: one line, exit 2, before any step
MESHTRAIN_FAULT_HOST_ALLOC=1 expect_exit 2 "offload: cannot allocate .* in .*host memory" offload_host_alloc_refused -- \
  "$BIN" train $M batch_size=8 offload=optimizer out_dir="$TMP/refused"
! grep -q '"step"' "$TMP/refused/log.jsonl" 2>/dev/null && ok offload_host_alloc_refused_before_training ||
  bad offload_host_alloc_refused_before_training

# -- the estimate: the optimizer's state leaves the GPU for the host, for each optimizer
E="vocab_size=50257 embed_dim=256 n_heads=4 n_layers=4 context_len=64 batch_size=4 device=cuda"
est=$("$BIN" estimate $E)
est_f=$("$BIN" estimate $E fsdp=true world_size=2)
gpu_of() { awk -v o="offload=$1" -v k="$2" '$1 == o && $2 == k {print $3 " " $4}' <<<"$est"; }
host_of() { awk -v o="offload=$1" -v k="$2" '$1 == o && $2 == k {print $5 " " $6}' <<<"$est"; }
to_b() { awk '{m = $2 == "B" ? 1 : $2 == "KiB" ? 1024 : $2 == "MiB" ? 1048576 : $2 == "GiB" ? 1073741824 : 0; printf "%.0f\n", $1 * m}'; }
g0=$(gpu_of none adamw | to_b); g1=$(gpu_of optimizer adamw | to_b); h0=$(host_of none adamw | to_b)
h1=$(host_of optimizer adamw | to_b); ha=$(host_of optimizer adafactor | to_b)
gf1=$(echo "$est_f" | awk '$1 == "offload=optimizer" && $2 == "adamw" {print $3 " " $4}' | to_b)
gf2=$(echo "$est_f" | awk '$1 == "offload=params" && $2 == "adamw" {print $3 " " $4}' | to_b)
P=$("$BIN" estimate $E | awk '$1 == "parameters:" {gsub(",", "", $2); print $2}')
# AdamW under DDP is lean: with precision=mixed (the GPU's default) m, v and the fp32 parameters
# (12 B/param) leave the GPU, which gains two bf16 staging buffers of the largest unit (the head,
# V x E + E); the host holds the master, m, v (12 B/param) and a bf16 gradients' copy (2 B/param).
# Adafactor (not lean: master and fp32 gradients, 8 B/param, and its statistics) holds less.
if [ -n "$g1" ] && [ "$h0" = 0 ] && awk -v g0="$g0" -v g1="$g1" -v h1="$h1" -v ha="$ha" -v P="$P" -v S=$((4 * (50257 * 256 + 256))) \
     'BEGIN {d = (g0 - g1 + S) / (12 * P); h = h1 / (14 * P); exit !(d > 0.99 && d < 1.01 && h > 0.99 && h < 1.01 && ha < h1 / 1.6)}'
then ok "offload_estimate_table (GPU $g0 -> $g1 B, host $h1 B; adafactor host $ha B)"
else bad "offload_estimate_table ($g0 $g1 $h0 $h1 $ha P=$P)"; echo "$est"; fi
# with precision=fp32: m and v (8 B/param) leave the GPU; the host holds them, the master and the
# gradients' copy (16 B/param)
est=$("$BIN" estimate $E precision=fp32)
g0=$(gpu_of none adamw | to_b); g1=$(gpu_of optimizer adamw | to_b); h1=$(host_of optimizer adamw | to_b)
if [ -n "$g1" ] && awk -v g0="$g0" -v g1="$g1" -v h1="$h1" -v P="$P" \
     'BEGIN {d = (g0 - g1) / (8 * P); h = h1 / (16 * P); exit !(d > 0.99 && d < 1.01 && h > 0.99 && h < 1.01)}'
then ok "offload_estimate_table_fp32 (GPU $g0 -> $g1 B, host $h1 B)"
else bad "offload_estimate_table_fp32 ($g0 $g1 $h1 P=$P)"; echo "$est"; fi
# ZeRO-1 keeps today's layout (not lean): 8 B/param leave the GPU, 16 B/param on the host
est=$("$BIN" estimate $E zero_opt=true world_size=2)
g0=$(gpu_of none adamw | to_b); g1=$(gpu_of optimizer adamw | to_b); h1=$(host_of optimizer adamw | to_b)
if [ -n "$g1" ] && awk -v g0="$g0" -v g1="$g1" -v h1="$h1" -v P="$P" \
     'BEGIN {d = (g0 - g1) / (4 * P); h = h1 / (8 * P); exit !(d > 0.99 && d < 1.01 && h > 0.99 && h < 1.01)}'
then ok "offload_estimate_zero1_not_lean (GPU $g0 -> $g1 B, host $h1 B)"
else bad "offload_estimate_zero1_not_lean ($g0 $g1 $h1 P=$P)"; echo "$est"; fi
# offload=params (FSDP over 2): the parameter shard (4 B/param / 2) leaves the GPU too
if [ -n "$gf2" ] && awk -v a="$gf1" -v b="$gf2" -v P="$P" 'BEGIN {d = (a - b) / (2 * P); exit !(d > 0.99 && d < 1.01)}'
then ok "offload_params_estimate (GPU $gf1 -> $gf2 B)"; else bad "offload_params_estimate ($gf1 $gf2)"; echo "$est_f"; fi

echo "RESULT $pass $fail"
[ "$fail" -eq 0 ]
