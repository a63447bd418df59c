#!/usr/bin/env bash
# Gradient accumulation: grad_accum_steps=k micro-batches of batch_size B make the same
# optimizer step as one batch of k x B (the loss averaged over all the step's tokens), on
# one process and with every data-parallel strategy (k x B x ranks = 8 sequences):
# the losses within 1e-5 relative over 5 steps and the final parameters within 1e-5;
# steps, tokens/s and checkpoints count whole optimizer steps, and a resume keeps k.
set -u
BIN=${MESHTRAIN_BIN:-build/meshtrain}
DIFF=$(dirname "$BIN")/tests/ckpt_diff
TMP=$(mktemp -d /tmp/meshtrain-accum.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
pass=0; fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }

D=$TMP/data
head -c 300000 data/tinystories/TinyStories-train.head-2MiB.txt > "$TMP/stories.txt"
"$BIN" prepare input="$TMP/stories.txt" data_dir="$D" >/dev/null || { echo "RESULT 0 1"; exit 1; }

losses() { grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$1/log.jsonl" | cut -d: -f3; }
# follows REF RUN: every step's loss within 1e-5 relative, and the final parameters
follows() {
  local a b
  a=$(losses "$1"); b=$(losses "$2")
  [ -n "$a" ] && [ "$(echo "$a" | wc -l)" -eq "$(echo "$b" | wc -l)" ] || return 1
  paste <(echo "$a") <(echo "$b") | awk '{d=($1-$2)/$1; if (d<0) d=-d; if (d>1e-5) bad=1} END{exit bad}' || return 1
  local out; out=$("$DIFF" "$1/ckpt.bin" "$2/ckpt.bin") || return 1
  [ "$(grep -c '^max_rel_diff' <<<"$out")" -eq 1 ] && awk '/^max_rel_diff/ {exit !($2 < 1e-5)}' <<<"$out"
}

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 data_dir=$D"
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

# with data parallelism: DDP and ZeRO-1 reduce once a step (after the last micro-batch),
# ZeRO-2, FSDP and hybrid FSDP add every micro-batch's reduced gradient into the shard
if command -v mpirun >/dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
  MPIRUN="mpirun --oversubscribe --bind-to none --stdin none"
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
