#!/usr/bin/env bash
# Mixture of experts on CPU ranks: every data-parallel strategy and the pipeline follow the
# single-process run of a MoE model (losses within 1e-5 relative for 5 steps, the same final
# parameters; the router's load-balancing loss is the global micro-batch's, so it is the same
# on every layout), with a balanced router and a skewed one; the gradient norm is the single
# process's; activation checkpointing and a resume are bitwise; two runs are bitwise equal; the
# log holds the router's statistics; eval and sample read a MoE checkpoint; bad values are one
# line and exit 2.
TEST_NAME=moe
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 400000
# The parameters after 5 AdamW steps within 3e-5 (not 1e-5): the router's statistics are summed
# over the ranks in another order than one process sums them, and the z-loss's gradient
# carries that rounding into every layer below; AdamW's first steps, which divide by the
# gradients' own size, enlarge it (4 ranks with a skewed router: 1.4e-5 at layer 0's qkv_proj,
# 8e-6 without either loss). The losses are held to 1e-5.
PARAM_TOL=$([ "${MESHTRAIN_SANITIZED:-}" = 1 ] && echo 5e-5 || echo 3e-5)

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 data_dir=$D moe_experts=4 moe_top_k=2 moe_z_loss=1e-3"

# -- data parallel: one micro-batch of the same global batch, balanced and skewed (a fixed
# selection bias favouring the first experts: MESHTRAIN_MOE_SKEW)
for skew in 0 60; do
  env MESHTRAIN_MOE_SKEW=$skew "$BIN" train $M batch_size=8 out_dir="$TMP/ref_$skew" >/dev/null 2>&1
  # (the sanitizer build: the layouts with the skewed router only)
  [ -n "${MESHTRAIN_SANITIZED:-}" ] && [ $skew = 0 ] && continue
  while IFS='|' read -r name np keys; do
    skip_sanitized "$name" && continue
    name=${name#\~}
    out=$TMP/${name}_${np}_$skew
    if $MPIRUN -np "$np" -x MESHTRAIN_MOE_SKEW=$skew "$BIN" train $M batch_size=$((8 / np)) $keys out_dir="$out" \
         >"$out.log" 2>&1 && follows "$TMP/ref_$skew" "$out" && same_norms "$TMP/ref_$skew" "$out"
    then ok "${name}_np${np}_skew$skew"
    else bad "${name}_np${np}_skew$skew ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
  done <<'CASES'
ddp|2|
~ddp|4|
zero1|2|zero_opt=true
zero2|2|fsdp=true shard_strategy=grad_op
~zero2|4|fsdp=true shard_strategy=grad_op
fsdp|2|fsdp=true shard_strategy=full
fsdp|4|fsdp=true shard_strategy=full
~hybrid|4|fsdp=true shard_strategy=hybrid shard_group_size=2
CASES
done
# the skew is real: one expert of each layer takes most of the choices
imb() { grep -o '"imbalance":[0-9.]*' "$1/log.jsonl" | head -1 | cut -d: -f2; }
awk -v a="$(imb "$TMP/ref_0")" -v b="$(imb "$TMP/ref_60")" 'BEGIN{exit !(b > 1.5 && b > a)}' &&
  ok skewed_router_is_skewed || bad "skewed_router_is_skewed (max/mean $(imb "$TMP/ref_0") and $(imb "$TMP/ref_60"))"

# -- micro-batches: accumulation and the pipeline's schedules follow one process that
# accumulates as many micro-batches (the load-balancing loss is each micro-batch's)
"$BIN" train $M batch_size=4 grad_accum_steps=2 out_dir="$TMP/acc" >/dev/null 2>&1
M4="${M/n_layers=2/n_layers=4}"
"$BIN" train $M4 batch_size=2 grad_accum_steps=4 out_dir="$TMP/acc4" >/dev/null 2>&1
while IFS='|' read -r name np ref model keys; do
  skip_sanitized "$name" && continue
  name=${name#\~}
  eval "mk=\$$model"
  out=$TMP/$name
  if $MPIRUN -np "$np" "$BIN" train $mk $keys out_dir="$out" >"$out.log" 2>&1 && follows "$TMP/$ref" "$out"
  then ok "$name"; else bad "$name ($(tail -2 "$out.log" | tr '\n' ' '))"; fi
done <<'CASES'
ddp_accumulate_np2|2|acc|M|batch_size=2 grad_accum_steps=2
pp2_1f1b|2|acc|M|batch_size=8 pipeline_parallel_size=2 micro_batches=2
~pp2_gpipe|2|acc|M|batch_size=8 pipeline_parallel_size=2 micro_batches=2 pipeline_schedule=gpipe
pp2_interleaved|2|acc4|M4|batch_size=8 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=interleaved
pp2_fsdp2|4|acc|M|batch_size=4 pipeline_parallel_size=2 micro_batches=2 fsdp=true
CASES

# -- moe_every=2 (a dense layer and a MoE layer), shared experts, the sigmoid router: DDP
# follows one process
for keys in "moe_every=2" "moe_shared_experts=1 moe_expert_dim=8" "moe_router=sigmoid"; do
  name=$(echo "$keys" | cut -d' ' -f1 | tr '=' '_')
  "$BIN" train $M $keys batch_size=8 out_dir="$TMP/v_$name" >/dev/null 2>&1
  if $MPIRUN -np 2 "$BIN" train $M $keys batch_size=4 out_dir="$TMP/v2_$name" >"$TMP/v2_$name.log" 2>&1 &&
     follows "$TMP/v_$name" "$TMP/v2_$name"
  then ok "ddp_np2_$name"; else bad "ddp_np2_$name ($(tail -2 "$TMP/v2_$name.log" | tr '\n' ' '))"; fi
done

# -- bitwise: activation checkpointing recomputes the same routing; two runs are alike
strip() { grep '^{"step":[0-9]*,"loss"' "$1/log.jsonl" | sed 's/,"ms".*//'; }
"$BIN" train $M batch_size=8 activation_checkpointing=true out_dir="$TMP/ac" >/dev/null 2>&1
[ -n "$(strip "$TMP/ac")" ] && [ "$(strip "$TMP/ac")" = "$(strip "$TMP/ref_0")" ] && cmp -s "$TMP/ac/ckpt.bin" "$TMP/ref_0/ckpt.bin" &&
  ok activation_checkpointing_bitwise || bad activation_checkpointing_bitwise
"$BIN" train $M batch_size=8 out_dir="$TMP/again" >/dev/null 2>&1
cmp -s "$TMP/again/ckpt.bin" "$TMP/ref_0/ckpt.bin" && [ "$(strip "$TMP/again")" = "$(strip "$TMP/ref_0")" ] &&
  ok two_runs_bitwise || bad two_runs_bitwise

# -- a resume continues bitwise as the uninterrupted run, on another layout too
"$BIN" train ${M/steps=5/steps=3} batch_size=8 lr_decay_steps=5 out_dir="$TMP/part" >/dev/null 2>&1
"$BIN" train $M batch_size=8 resume="$TMP/part/ckpt.bin" out_dir="$TMP/resumed" >/dev/null 2>&1
"$DIFF" "$TMP/resumed/ckpt.bin" "$TMP/ref_0/ckpt.bin" | grep -qx 'max_rel_diff 0' &&
  ok resume_bitwise || bad "resume_bitwise ($("$DIFF" "$TMP/resumed/ckpt.bin" "$TMP/ref_0/ckpt.bin" 2>&1))"
$MPIRUN -np 2 "$BIN" train $M resume="$TMP/part/ckpt.bin" fsdp=true out_dir="$TMP/resumed2" >"$TMP/resumed2.log" 2>&1
params_close "$TMP/resumed2/ckpt.bin" "$TMP/ref_0/ckpt.bin" && ok resume_on_fsdp_np2 ||
  bad "resume_on_fsdp_np2 ($(tail -2 "$TMP/resumed2.log" | tr '\n' ' '))"

# -- aux-loss-free balancing: the selection biases even a skewed router's load (the mean
# imbalance of the last 10 of 12 steps falls), are saved beside the checkpoint and resumed
# bitwise, and eval routes with them
MB="${M/steps=5/steps=12} batch_size=8 moe_aux_loss=0"
mean_imb() { grep -o '"imbalance":[0-9.]*' "$1/log.jsonl" | cut -d: -f2 | tail -n +5 | awk '{s+=$1} END{print s/NR}'; }
MESHTRAIN_MOE_SKEW=60 "$BIN" train $MB ckpt_path=none out_dir="$TMP/nobal" >/dev/null 2>&1
MESHTRAIN_MOE_SKEW=60 "$BIN" train $MB moe_bias_balance=0.01 ckpt_path=none out_dir="$TMP/bal" >/dev/null 2>&1
awk -v a="$(mean_imb "$TMP/nobal")" -v b="$(mean_imb "$TMP/bal")" 'BEGIN{exit !(b + 0.05 < a)}' &&
  ok bias_balance_evens_the_load || bad "bias_balance_evens_the_load (mean max/mean $(mean_imb "$TMP/nobal") without, $(mean_imb "$TMP/bal") with)"
MB6="${M/steps=5/steps=6} batch_size=8 moe_bias_balance=0.01"
"$BIN" train $MB6 out_dir="$TMP/bal6" >/dev/null 2>&1
"$BIN" train ${MB6/steps=6/steps=3} lr_decay_steps=6 ckpt_every=2 out_dir="$TMP/bal3" >/dev/null 2>&1
ls "$TMP/bal3" | grep -q 's00000002.moebias' && bad "bias_file_of_older_step_removed" || ok bias_file_of_older_step_removed
"$BIN" train $MB6 resume="$TMP/bal3/ckpt.bin" out_dir="$TMP/bal3r" >/dev/null 2>&1
"$DIFF" "$TMP/bal3r/ckpt.bin" "$TMP/bal6/ckpt.bin" | grep -qx 'max_rel_diff 0' && [ -s "$TMP/bal3r/ckpt.bin.s00000006.moebias" ] &&
  cmp -s "$TMP/bal3r/ckpt.bin.s00000006.moebias" "$TMP/bal6/ckpt.bin.s00000006.moebias" &&
  ok bias_balance_resume_bitwise || bad bias_balance_resume_bitwise
if "$BIN" eval checkpoint="$TMP/bal6/ckpt.bin" data_dir="$D" >"$TMP/evalb.out" 2>&1 &&
   awk -v a="$(grep -o 'val_loss [0-9.]*' "$TMP/evalb.out" | cut -d' ' -f2)" \
       -v b="$(grep -o '"val_loss":[0-9.]*' "$TMP/bal6/log.jsonl" | tail -1 | cut -d: -f2)" 'BEGIN{d=a-b; if(d<0)d=-d; exit !(d < 1e-4)}'
then ok eval_routes_with_biases; else bad "eval_routes_with_biases ($(tail -1 "$TMP/evalb.out"))"; fi
printf 'garbage' > "$TMP/bal3/ckpt.bin.s00000003.moebias"
expect_exit 2 "moebias.*corrupt" bias_file_corrupt -- "$BIN" train $MB6 resume="$TMP/bal3/ckpt.bin" out_dir="$TMP/bal3c"
rm -f "$TMP/bal3/ckpt.bin.s00000003.moebias"
expect_exit 2 "keeps its MoE router biases beside it" bias_file_missing -- "$BIN" eval checkpoint="$TMP/bal3/ckpt.bin" data_dir="$D"

# -- the log: per layer the least and most loaded expert and the imbalance, the losses;
# with a binding capacity, a drop rate above 0 (and none dropless)
if python3 - "$TMP/ref_0/log.jsonl" <<'EOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l and '"step"' in l]
s = steps[0]
m = s["moe"]
assert len(m["layers"]) == 2 and all(l["min"] <= l["max"] and l["imbalance"] >= 1 for l in m["layers"])
assert 0.9 < s["moe_aux"] < 2 and s["moe_z"] > 0 and s["moe_drop"] == 0, s
assert s["moe_imbalance"] == max(l["imbalance"] for l in m["layers"])
assert sum(int(l["max"]) for l in m["layers"]) > 0
EOF
then ok log_router_statistics; else bad log_router_statistics; fi
# plot draws the router (its load-balancing loss and the largest imbalance) in a fourth panel
"$BIN" plot log="$TMP/ref_0/log.jsonl" out="$TMP/moe.svg" >/dev/null 2>&1 &&
  grep -q 'id="panel-router"' "$TMP/moe.svg" && grep -q 'id="moe-aux-line"' "$TMP/moe.svg" &&
  grep -q 'id="moe-imbalance-line"' "$TMP/moe.svg" && ok plot_draws_router || bad plot_draws_router
"$BIN" train ${M/steps=5/steps=2} batch_size=8 moe_capacity_factor=0.5 ckpt_path=none out_dir="$TMP/cap" >"$TMP/cap.out" 2>&1
grep -q 'dropped' "$TMP/cap.out" && grep -o '"moe_drop":[0-9.]*' "$TMP/cap/log.jsonl" | head -1 | awk -F: '{exit !($2 > 0.05)}' &&
  ok capacity_drops_logged || bad "capacity_drops_logged ($(tail -1 "$TMP/cap.out"))"

# -- eval and sample read a MoE checkpoint in one process (saved by two FSDP ranks)
if "$BIN" eval checkpoint="$TMP/fsdp_2_60/ckpt.bin" data_dir="$D" >"$TMP/eval.out" 2>&1 &&
   want=$(grep -o '"val_loss":[0-9.]*' "$TMP/fsdp_2_60/log.jsonl" | tail -1 | cut -d: -f2) &&
   awk -v a="$(grep -o 'val_loss [0-9.]*' "$TMP/eval.out" | cut -d' ' -f2)" -v b="$want" 'BEGIN{d=a-b; if(d<0)d=-d; exit !(d < 1e-4)}'
then ok eval_reads_moe_checkpoint; else bad "eval_reads_moe_checkpoint ($(tail -1 "$TMP/eval.out"))"; fi
"$BIN" sample checkpoint="$TMP/fsdp_2_60/ckpt.bin" prompt="Once upon a time" length=8 >"$TMP/sample.out" 2>&1 &&
  [ -s "$TMP/sample.out" ] && ok sample_reads_moe_checkpoint || bad "sample_reads_moe_checkpoint ($(tail -1 "$TMP/sample.out"))"

# -- bad values: one line, exit 2, before any work
B="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 batch_size=2 steps=1 data_dir=$D ckpt_path=none out_dir=$TMP/bad"
expect_exit 2 "moe_top_k=5 must be between 1 and moe_experts=4" top_k_above_experts -- "$BIN" train $B moe_experts=4 moe_top_k=5
expect_exit 2 "moe_top_k applies to a mixture of experts" moe_key_without_experts -- "$BIN" train $B moe_top_k=2
expect_exit 2 "moe_every=3 leaves no MoE layer" moe_every_past_layers -- "$BIN" train $B moe_experts=4 moe_every=3
expect_exit 2 "zb1 does not take MoE layers" moe_with_zb1 -- "$BIN" train $B moe_experts=4 pipeline_parallel_size=2 micro_batches=2 pipeline_schedule=zb1
expect_exit 2 "moe_experts=8 differs from checkpoint" resume_other_experts -- "$BIN" train ${B/steps=1/steps=9} moe_experts=8 resume="$TMP/ref_0/ckpt.bin"
expect_exit 2 "moe_capacity_factor=0.5 differs from checkpoint" resume_other_capacity -- "$BIN" train ${B/steps=1/steps=9} \
  moe_experts=4 moe_capacity_factor=0.5 resume="$TMP/ref_0/ckpt.bin"

echo "RESULT $pass $fail"
[ "$fail" -eq 0 ]
