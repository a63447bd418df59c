#!/usr/bin/env bash
# End-to-end tests of the meshtrain command line: bad input gives one line and exit 2,
# training works, checkpoints resume bitwise, NaN stops cleanly, the estimate is honest.
TEST_NAME=cli
source "$(dirname "$0")/lib.sh"

# sane_loss X: X is a finite number, above 0 and below ln(50257) + 1 (a uniform guess over
# GPT-2's vocabulary is ln(50257) = 10.8; nan, -nan and inf are refused)
sane_loss() { awk -v x="$1" 'BEGIN { exit !(x ~ /^[0-9]+(\.[0-9]+)?$/ && x + 0 > 0 && x + 0 < log(50257) + 1) }'; }

TINY="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=1 context_len=32 batch_size=4"
D=$TMP/data
# -- prepare: a small corpus from the mirrored TinyStories text
head -c 300000 data/tinystories/TinyStories-train.head-2MiB.txt > "$TMP/stories.txt"
if "$BIN" prepare input="$TMP/stories.txt" data_dir="$D" val_fraction=0.1 >/dev/null && [ -s "$D/train.bin" ] && [ -s "$D/val.bin" ]
then ok prepare; else bad prepare; fi

# -- MESHTRAIN_PROFILE=1: a per-op time table on stderr at exit, naming the ops that ran in
# every step but the first (3 steps: 2 counted)
# ckpt_path=none: the run saves no checkpoint (a benchmark of a big model need not write one)
o=$("$BIN" train $TINY steps=2 data_dir="$D" out_dir="$TMP/nockpt" ckpt_path=none progress=false 2>&1)
if [ $? -eq 0 ] && grep -q "checkpoint: none" <<<"$o" && [ -s "$TMP/nockpt/log.jsonl" ] && ! ls "$TMP/nockpt" | grep -q ckpt
then ok no_checkpoint; else bad "no_checkpoint ($(tail -1 <<<"$o"))"; fi
expect_exit 2 "ckpt_every=5 saves nothing with ckpt_path=none" ckpt_every_without_path -- "$BIN" train $TINY ckpt_path=none ckpt_every=5
prof=$(MESHTRAIN_PROFILE=1 "$BIN" train $TINY steps=3 data_dir="$D" out_dir="$TMP/prof" progress=false 2>&1 >/dev/null)
if grep -q "^ops profile (MESHTRAIN_PROFILE=1, cpu)" <<<"$prof" && grep -q "matmul_backward (lm_head) .* 2 calls" <<<"$prof" &&
   grep -q "attention_backward .* 2 calls" <<<"$prof"; then ok profile_table; else bad "profile_table ($prof)"; fi
# MESHTRAIN_PROFILE=events on a backend without device events: the synchronised table, said so
prof=$(MESHTRAIN_PROFILE=events "$BIN" train $TINY steps=3 data_dir="$D" out_dir="$TMP/prof_ev" progress=false 2>&1 >/dev/null)
if grep -q "^ops profile (MESHTRAIN_PROFILE=1, cpu)" <<<"$prof" && grep -q "matmul_backward (lm_head) .* 2 calls" <<<"$prof"
then ok profile_events_on_cpu; else bad "profile_events_on_cpu ($prof)"; fi

# -- bad keys and values
expect_exit 2 "unknown key 'embed_dimm'" unknown_key -- "$BIN" train embed_dimm=3
expect_exit 2 "embed_dim=abc: not an integer" malformed_int -- "$BIN" train embed_dim=abc
expect_exit 2 "lr=-1: out of range" out_of_range -- "$BIN" train lr=-1
expect_exit 2 "expected key=value" not_key_value -- "$BIN" train embed_dim
expect_exit 2 "tie_embeddings=maybe: expected true or false" bad_bool -- "$BIN" train tie_embeddings=maybe
expect_exit 2 "n_heads=3 does not divide embed_dim=32" heads_divide -- "$BIN" train embed_dim=32 n_heads=3
expect_exit 2 "head_dim .* is odd" odd_head_dim -- "$BIN" train embed_dim=36 n_heads=4
expect_exit 2 "head_dim = embed_dim/n_heads = 512: device=cuda's attention takes heads of up to 256" cuda_head_dim \
  -- "$BIN" train embed_dim=2048 n_heads=4 device=cuda
expect_exit 2 "unknown command" unknown_command -- "$BIN" trian
expect_exit 2 "precision=mixed needs a GPU" cpu_precision -- "$BIN" train precision=mixed
expect_exit 2 "given twice" key_twice -- "$BIN" train lr=1 lr=2
expect_exit 2 "does not apply" wrong_subcommand -- "$BIN" prepare lr=1

# -- device=cuda: trains where there is a GPU; else one line saying why (a build without
# nvcc, or no GPU/driver), exit 2. Several processes on cuda: refused by a build without
# NCCL; with NCCL they train where there are GPUs, else each rank says why.
# trained_on_cuda OUT LOG N NP: a run that exited 0 trained on the GPU: its header (stdout
# OUT) names device cuda and NP process(es), and its log LOG has the step lines 1..N, each
# with a sane loss. WHY says what is missing.
trained_on_cuda() {
  local h steps v procs; h=$(grep -m1 '^meshtrain train  (device' "$1")
  procs="$4 process"; [ "$4" -gt 1 ] && procs="${procs}es"
  [[ $h == "meshtrain train  (device cuda"[\ ,]* && $h == *", $procs:"* ]] || { WHY="header: ${h:-none}"; return 1; }
  steps=$(grep -o '^{"step":[0-9]*,"loss":[^,]*' "$2" 2>/dev/null | cut -d: -f2 | cut -d, -f1 | paste -sd' ')
  [ "$steps" = "$(seq -s' ' 1 "$3")" ] || { WHY="log steps: [${steps}], want 1..$3"; return 1; }
  for v in $(grep -o '^{"step":[0-9]*,"loss":[^,]*' "$2" | cut -d: -f3); do
    sane_loss "$v" || { WHY="loss $v"; return 1; }
  done
}
err=$("$BIN" train $TINY device=cuda steps=1 data_dir="$D" out_dir="$TMP/cu" progress=false 2>&1 >"$TMP/cu.out"); rc=$?
if { [ $rc -eq 0 ] && trained_on_cuda "$TMP/cu.out" "$TMP/cu/log.jsonl" 1 1; } || { [ $rc -eq 2 ] && [ "$(printf '%s' "$err" | grep -c '')" -eq 1 ] &&
   printf '%s' "$err" | grep -qE "no CUDA support \(nvcc was not found at build time\)|cuda: no usable GPU"; }
then ok "cuda_trains_or_says_why ($([ $rc -eq 0 ] && echo "trained: $(head -1 "$TMP/cu.out")" || echo "$err"))"
else bad "cuda_trains_or_says_why (exit $rc: $([ $rc -eq 0 ] && echo "$WHY" || echo "$err"))"; fi
if command -v mpirun >/dev/null; then
  err=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
        OMPI_MCA_btl_vader_single_copy_mechanism=none ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" \
        mpirun --oversubscribe --bind-to none --stdin none -np 2 "$BIN" train $TINY device=cuda data_dir="$D" steps=2 out_dir="$TMP/cuda_mp" 2>&1 >"$TMP/cuda_mp.out"); rc=$?
  if { [ $rc -eq 0 ] && trained_on_cuda "$TMP/cuda_mp.out" "$TMP/cuda_mp/log.jsonl" 2 2; } ||
     { [ $rc -eq 2 ] && printf '%s' "$err" | grep -qE "this build has no NCCL|no CUDA support|cuda: no usable GPU"; }
  then ok "cuda_multi_process_trains_or_says_why ($([ $rc -eq 0 ] && echo "trained: $(head -1 "$TMP/cuda_mp.out")" || echo "$err" | head -1))"
  else bad "cuda_multi_process_trains_or_says_why (exit $rc: $([ $rc -eq 0 ] && echo "$WHY" || echo "$err"))"; fi
fi
"$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 device=cuda precision=fp32 | grep -q "memory per GPU (fp32, cuda" && ok estimate_cuda || bad estimate_cuda
# the header names the data-parallel group the strategy spans, and the whole world beside it under
# tensor (or pipeline) parallel
h1=$("$BIN" estimate world_size=2 | grep "^memory per")
h2=$("$BIN" estimate world_size=4 tensor_parallel_size=2 n_heads=4 fsdp=true | grep "^memory per")
if [[ $h1 == *"ddp over 2 data-parallel ranks):" ]] && [[ $h2 == *"fsdp over 2 data-parallel ranks of the 4 in all):" ]]
then ok estimate_names_data_parallel_group; else bad "estimate_names_data_parallel_group ($h1 / $h2)"; fi
# cuda defaults to mixed precision: bf16 activations (half of fp32's) and bf16 weight copies
# the estimate takes train's grad_accum_steps: the same memory (one micro-batch's), the global batch printed
a1=$("$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 batch_size=8 | grep '^  total')
a4=$("$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 batch_size=8 grad_accum_steps=4 world_size=2)
if [ -n "$a1" ] && grep -q "global batch 64 sequences" <<<"$a4"; then ok estimate_grad_accum; else bad "estimate_grad_accum ($a4)"; fi
est_acts() { "$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 device=cuda "$@" | awk '$1 == "activations" {print $2 $3}'; }
m=$("$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 device=cuda)
# about half: the bf16 activations; the fp32 statistics (rstd, lse) and token ids stay
to_bytes() { awk '{v = $1 + 0; u = substr($1, length($1) - 2); print v * (u == "KiB" ? 1024 : u == "MiB" ? 1048576 : u == "GiB" ? 1073741824 : 1)}' <<<"$1"; }
am=$(to_bytes "$(est_acts)") af=$(to_bytes "$(est_acts precision=fp32)")
if grep -q "memory per GPU (mixed" <<<"$m" && grep -q "bf16 weight copies" <<<"$m" &&
   awk -v a="$am" -v b="$af" 'BEGIN { exit !(b > 0 && a / b > 0.45 && a / b < 0.55) }'; then
  ok estimate_cuda_mixed; else bad estimate_cuda_mixed; fi
# precision=bf16: parameters, gradients and moments in bf16 (half of mixed's), no weight copies
half_of() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > 0 && a * 2 > b * 0.999 && a * 2 < b * 1.001) }'; }
m=$("$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 device=cuda precision=bf16)
pb=$(awk '$1 == "parameters" && NF == 3 {print $2}' <<<"$m")
pm=$("$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 device=cuda precision=mixed | awk '$1 == "parameters" && NF == 3 {print $2}')
ob=$(awk '$1 == "optimizer" {print $5}' <<<"$m")
om=$("$BIN" estimate embed_dim=256 n_heads=4 n_layers=4 device=cuda precision=mixed | awk '$1 == "optimizer" {print $5}')
if grep -q "memory per GPU (bf16" <<<"$m" && ! grep -q "weight copies" <<<"$m" && half_of "$pb" "$pm" && half_of "$ob" "$om" \
   && [ "$(est_acts precision=bf16)" = "$(est_acts)" ]; then
  ok estimate_cuda_bf16; else bad "estimate_cuda_bf16 ($pb vs $pm, $ob vs $om)"; fi
# DDP on several GPUs: the copy-engine all-reduce's receive buffer, 64 MiB (or the gradients'
# size when smaller), only with world_size > 1 and copy_engines=true, and in the total (printed
# to 0.1 GiB: batch_size=32 is a size where the 64 MiB moves it, 8.3 -> 8.4 GiB)
ce() { "$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 batch_size=32 device=cuda "$@"; }
a=$(ce world_size=4 | awk '$1 == "all-to-all" {print $3, $4}')
t1=$(ce world_size=4 | awk '$1 == "total" {print $2}'); t0=$(ce world_size=4 copy_engines=false | awk '$1 == "total" {print $2}')
if [ "$a" = "64.0 MiB" ] && ! ce world_size=4 copy_engines=false | grep -q "all-to-all" && ! ce | grep -q "all-to-all" \
   && ! ce world_size=4 zero_opt=true | grep -q "all-to-all" && [ "$t1" != "$t0" ]; then
  ok estimate_copy_engine_buffer; else bad "estimate_copy_engine_buffer ($a; $t1 vs $t0)"; fi
# pipeline send/receive on the copy engines (pp_copy_engines=true, the default): a stage counts a ring of 4 slots of
# a micro-batch's residual stream (8 x 256 x 1024 bf16 = 4 MiB) and the counters, each end's block
# in whole 2 MiB pages (16 MiB + 2 + 2), for each direction it receives in:
# 1F1B's first stage its gradients, its last its activations; interleaved's both; none with
# pp_copy_engines=false or on device=cpu; unset counts as true
rings() { "$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 batch_size=32 world_size=2 \
            pipeline_parallel_size=2 micro_batches=4 ${DEV:-device=cuda} ${SCHED:-} "$@" | grep "^  stage" |
          grep -o "receive rings [0-9.]* [KMG]iB" | cut -d' ' -f3- | tr '\n' ' '; }
r1=$(rings pp_copy_engines=true) ri=$(SCHED=pipeline_schedule=interleaved rings pp_copy_engines=true)
r0=$(rings pp_copy_engines=false) rc=$(DEV=device=cpu rings pp_copy_engines=true) rd=$(rings)
if [ "$r1" = "20.0 MiB 20.0 MiB " ] && [ "$ri" = "40.0 MiB 40.0 MiB " ] && [ -z "$r0" ] && [ -z "$rc" ] && [ "$rd" = "$r1" ]
then ok estimate_pipeline_receive_rings
else bad "estimate_pipeline_receive_rings (1f1b: $r1; interleaved: $ri; off: $r0; cpu: $rc; default: $rd)"; fi
expect_exit 2 "pp_copy_engines=yes: expected true or false" estimate_refuses_bad_pp_ce -- \
  "$BIN" estimate device=cuda pipeline_parallel_size=2 world_size=2 micro_batches=2 pp_copy_engines=yes
expect_exit 2 "pp_copy_engines applies with pipeline_parallel_size > 1" estimate_refuses_pp_ce_without_pipeline -- \
  "$BIN" estimate device=cuda world_size=2 pp_copy_engines=false
# zb1_max_in_flight: the estimate's zb1 stages hold what the cap lets them (the post's model at
# p=4, m=8: stage r min(2p + 1 - r, cap), the cap p + 3 = 7 by default); only with zb1, and a
# cap below 0 is refused
held() { "$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 batch_size=32 world_size=4 pipeline_parallel_size=4 \
           micro_batches=8 pipeline_schedule=zb1 "$@" | grep "^  stage" | grep -o "([0-9]* micro-batch[es]* in flight)" |
         tr -dc '0-9\n' | paste -sd' '; }
h0=$(held) h5=$(held zb1_max_in_flight=5) h1=$(held zb1_max_in_flight=1) h7=$(held zb1_max_in_flight=7)
if [ "$h0" = "7 7 7 6" ] && [ "$h5" = "5 5 5 5" ] && [ "$h1" = "1 1 1 1" ] && [ "$h7" = "$h0" ]
then ok estimate_zb1_max_in_flight; else bad "estimate_zb1_max_in_flight (default: $h0; 5: $h5; 1: $h1; 7: $h7)"; fi
expect_exit 2 "zb1_max_in_flight applies with pipeline_schedule=zb1, not pipeline_schedule=gpipe" \
  estimate_refuses_zb1_max_without_zb1 -- "$BIN" estimate pipeline_parallel_size=2 world_size=2 micro_batches=2 \
  pipeline_schedule=gpipe zb1_max_in_flight=3
expect_exit 2 "zb1_max_in_flight=-2: out of range" estimate_refuses_negative_zb1_max -- "$BIN" estimate \
  pipeline_parallel_size=2 world_size=2 micro_batches=2 pipeline_schedule=zb1 zb1_max_in_flight=-2
# a stage's ops run on micro-batches, so its scratch is a micro-batch's (rmsnorm's partials,
# attention's terms): the last stage of the post's model at 32 micro-batches of 4 sequences is
# its parts plus the runtime of a batch of 4, not of 128 (162 MiB; the GPU's peak was 659 MiB
# against 785 estimated, 2026-11-28)
P="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=bf16"
st=$("$BIN" estimate $P batch_size=128 pipeline_parallel_size=4 world_size=4 micro_batches=32 | grep "^  stage 3")
r4=$("$BIN" estimate $P batch_size=4 | awk '$1 == "runtime" {print $4}')
if awk -v l="$st" -v r="$r4" 'BEGIN {
     n = split(l, w, " "); s = 0; t = -1
     for (i = 1; i < n; i++) if (w[i + 1] ~ /^MiB/) { if (w[i - 1] == "total") t = w[i]; else s += w[i] }
     d = t - s - r; exit !(t > 0 && r > 0 && d < 0.3 && d > -0.3) }'
then ok estimate_stage_scratch_of_micro_batch
else bad "estimate_stage_scratch_of_micro_batch ($st; runtime at batch 4: $r4 MiB)"; fi
# the timing experiment's knob (the pipeline's copies left out) takes 0 or 1 only, on CPU runs too
expect_exit 2 "MESHTRAIN_PP_SKIP_COPIES=2: not 0 or 1" train_refuses_bad_pp_skip_copies -- \
  env MESHTRAIN_PP_SKIP_COPIES=2 "$BIN" train $TINY ckpt_path=none
# from T=1024 (head_dim 64, 96, 128 or 256, bf16 or mixed) attention's backward is counted on our Hopper
# kernel, whose workspace is far smaller than cuDNN's B NH T^2 dP: the estimate says so, and how
# much more cuDNN needs elsewhere (about 1.9 GiB for the post's model at 4096 x 8); not below
lc() { "$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 device=cuda precision=bf16 "$@"; }
rl=$(lc context_len=4096 batch_size=8 | awk '$1 == "runtime" {print $4, $5}')
if lc context_len=4096 batch_size=8 | grep -q "on other GPUs cuDNN's engine needs 1.9 GiB more" && [ "$rl" = "162.0 MiB" ] &&
   ! lc context_len=512 batch_size=64 | grep -q "on other GPUs" && ! lc context_len=4096 batch_size=8 precision=fp32 |
   grep -q "on other GPUs"
then ok estimate_attention_backward_workspace; else bad "estimate_attention_backward_workspace ($rl)"; fi
# the keys attention and deterministic choose the path, and the estimate counts that path's buffers:
# attention=cudnn keeps dP (B NH T^2 bf16, 2.0 GiB at 4096 x 8), with deterministic=false the fp32
# dQ accumulator instead (128 MiB), own neither; deterministic=false (auto's paths, atomic dQ in
# ours) is auto's Hopper kernel
r_det=$(lc context_len=4096 batch_size=8 attention=cudnn | awk '$1 == "runtime" {print $4, $5}')
r_at=$(lc context_len=4096 batch_size=8 attention=cudnn deterministic=false | awk '$1 == "runtime" {print $4, $5}')
r_own=$(lc context_len=4096 batch_size=8 attention=own | awk '$1 == "runtime" {print $4, $5}')
r_fast=$(lc context_len=4096 batch_size=8 deterministic=false | awk '$1 == "runtime" {print $4, $5}')
r_fast5=$(lc context_len=512 batch_size=64 deterministic=false | awk '$1 == "runtime" {print $4, $5}')
r_auto5=$(lc context_len=512 batch_size=64 | awk '$1 == "runtime" {print $4, $5}')
if [ "$r_det" = "2.0 GiB" ] && [ "$r_at" = "161.0 MiB" ] && [ "$r_own" = "36.0 MiB" ] &&
   [ "$r_fast" = "162.0 MiB" ] && [ "$r_fast5" = "$r_auto5" ] &&
   ! lc context_len=4096 batch_size=8 attention=cudnn | grep -q "Hopper kernel"
then ok estimate_follows_attention_keys; else bad "estimate_follows_attention_keys ($r_det, $r_at, $r_own, $r_fast, $r_fast5/$r_auto5)"; fi
expect_exit 2 "attention=bogus: expected one of auto\|cudnn\|own" estimate_refuses_bad_attention -- \
  "$BIN" estimate device=cuda precision=bf16 attention=bogus
expect_exit 2 "cuda_graphs=yes: expected one of auto\|true\|false" train_refuses_bad_cuda_graphs -- \
  "$BIN" train $TINY cuda_graphs=yes
# the variables these keys replace, and those whose alternative went, are one line and exit 2
expect_exit 2 "MESHTRAIN_ATTN is no longer read: use the keys attention=auto\|cudnn\|own and deterministic=" \
  retired_attention_variable -- env MESHTRAIN_ATTN=cudnn "$BIN" estimate device=cuda precision=bf16
expect_exit 2 "MESHTRAIN_MATMUL_TUNE is no longer read: use the key deterministic=false" retired_matmul_tune_variable -- \
  env MESHTRAIN_MATMUL_TUNE=1 "$BIN" train $TINY
for v in WGMMA_BWD_T WGMMA_GRID GEMM_SMS; do
  expect_exit 2 "MESHTRAIN_$v is no longer read: the alternative it chose was removed" "retired_variable_$v" -- \
    env "MESHTRAIN_$v=1" "$BIN" estimate device=cuda precision=bf16
done
# head_dim 96 (embed_dim 768, 8 heads) takes the Hopper backward from T=512 (measured faster there):
# its workspace at 4096 x 8 and 512 x 64 instead of cuDNN's dP, cuDNN's at 256 x 128
l96() { "$BIN" estimate embed_dim=768 n_heads=8 n_layers=16 device=cuda precision=bf16 "$@"; }
h_4k=$(l96 context_len=4096 batch_size=8 | awk '$1 == "runtime" {print $4, $5}')
h_512=$(l96 context_len=512 batch_size=64 | awk '$1 == "runtime" {print $4, $5}')
h_256=$(l96 context_len=256 batch_size=128 | awk '$1 == "runtime" {print $4, $5}')
if [ "$h_4k" = "130.0 MiB" ] && [ "$h_512" = "130.0 MiB" ] && [ "$h_256" = "162.0 MiB" ] &&
   l96 context_len=512 batch_size=64 | grep -q "our Hopper kernel" && ! l96 context_len=256 batch_size=128 | grep -q "Hopper kernel"
then ok estimate_hopper_backward_hd96; else bad "estimate_hopper_backward_hd96 ($h_4k, $h_512, $h_256)"; fi
# head_dim 256 (embed_dim 1024, 4 heads): our Hopper backward's deterministic mode trails cuDNN's there,
# so auto keeps cuDNN's (its dP: 1.0 GiB at 4096 x 8); deterministic=false (atomic dQ) takes ours
# from T=1024
l256() { "$BIN" estimate embed_dim=1024 n_heads=4 n_layers=16 device=cuda precision=bf16 "$@"; }
g_4k=$(l256 context_len=4096 batch_size=8 | awk '$1 == "runtime" {print $4, $5}')
g_f4k=$(l256 context_len=4096 batch_size=8 deterministic=false | awk '$1 == "runtime" {print $4, $5}')
g_f512=$(l256 context_len=512 batch_size=64 deterministic=false | awk '$1 == "runtime" {print $4, $5}')
if [ "$g_4k" = "1.0 GiB" ] && [ "$g_f4k" = "161.0 MiB" ] && [ "$g_f512" = "161.5 MiB" ] &&
   ! l256 context_len=4096 batch_size=8 | grep -q "Hopper kernel" &&
   l256 context_len=1024 batch_size=32 deterministic=false | grep -q "our Hopper kernel" &&
   ! l256 context_len=512 batch_size=64 deterministic=false | grep -q "Hopper kernel"
then ok estimate_hopper_backward_hd256; else bad "estimate_hopper_backward_hd256 ($g_4k, $g_f4k, $g_f512)"; fi
expect_exit 2 "precision=bf16 needs a GPU" bf16_needs_gpu -- "$BIN" train precision=bf16 device=cpu

# -- bad data
expect_exit 2 "not found" missing_shard -- "$BIN" train $TINY data_dir="$TMP/nowhere"
expect_exit 2 "context_len|too (small|short)|windows" context_too_long -- "$BIN" train $TINY context_len=1000000 data_dir="$D"
head -c 1000 "$D/train.bin" > "$TMP/trunc.bin"
expect_exit 2 "truncated" truncated_shard -- "$BIN" train $TINY train_data="$TMP/trunc.bin" val_data="$D/val.bin"
printf 'hello this is not a shard at all, just some text long enough for a header........' > "$TMP/foreign.bin"
expect_exit 2 "not a meshtrain shard" foreign_shard -- "$BIN" train $TINY train_data="$TMP/foreign.bin" val_data="$D/val.bin"
: > "$TMP/empty.txt"
expect_exit 2 "empty" prepare_empty -- "$BIN" prepare input="$TMP/empty.txt" data_dir="$TMP/d2"
printf 'Once upon a time \xff\xfe there was.\n<|endoftext|>\nAnother story.\n' > "$TMP/latin1.txt"
expect_exit 2 "UTF-8" prepare_non_utf8 -- "$BIN" prepare input="$TMP/latin1.txt" data_dir="$TMP/d3"
expect_exit 2 "cannot open|not found|No such" prepare_missing -- "$BIN" prepare input="$TMP/nothing.txt" data_dir="$TMP/d4"
expect_exit 2 "needs about .* only" does_not_fit -- "$BIN" train $TINY data_dir="$D" max_memory_gb=0.001

# -- training: the loss falls; the log has one JSON line per step
R=$TMP/run
if "$BIN" train $TINY data_dir="$D" steps=30 lr=3e-3 out_dir="$R" progress=false threads=2 > "$TMP/train.out"; then
  first=$(grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$R/log.jsonl" | head -1 | cut -d: -f3)
  last=$(grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$R/log.jsonl" | tail -1 | cut -d: -f3)
  n=$(grep -c '^{"step":[0-9]*,"loss"' "$R/log.jsonl")
  if [ "$n" -eq 30 ] && awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < a - 1.0)}'; then ok train_loss_falls
  else bad "train_loss_falls ($n lines, $first -> $last)"; fi
  # every val_loss printed (the last step's line and the summary) is a sane number
  vl=$(grep -o 'val_loss [^ ]*' "$TMP/train.out" | cut -d' ' -f2 | paste -sd' ')
  vl_ok=$([ -n "$vl" ] && echo 1 || echo 0)
  for v in $vl; do sane_loss "$v" || vl_ok=0; done
  [ "$vl_ok" = 1 ] && ok "train_prints_val_loss ($vl)" || bad "train_prints_val_loss (${vl:-none})"
else bad "train (exit $?)"; fi

# -- a validation shard shorter than one batch (224 windows of 32, batch_size=256): the
# smaller validation batch runs in the training buffers; its loss is what eval gives with
# batch_size=224, and the run's estimate is `meshtrain estimate`'s (plus the mapped data:
# within 1%, same unit), with no second set of activations
S=$TMP/shortval
if "$BIN" train ${TINY/batch_size=4/batch_size=256} data_dir="$D" steps=2 out_dir="$S" progress=false threads=2 \
     > "$S.out" 2>&1; then
  vt=$(grep -o 'val_loss [0-9.]*' "$S.out" | tail -1 | cut -d' ' -f2)
  ve=$("$BIN" eval checkpoint="$S/ckpt.bin" data_dir="$D" batch_size=224 threads=2 | grep -o 'val_loss [0-9.]*' | cut -d' ' -f2)
  est=$("$BIN" estimate ${TINY/batch_size=4/batch_size=256} | awk '$1 == "total" {print $2, $3}')
  run=$(grep -o 'estimate [0-9.]* [KMG]iB' "$S.out" | awk '{print $2, $3}')
  close=$(awk -v a="$run" -v b="$est" 'BEGIN {split(a, x, " "); split(b, y, " ");
    print (x[2] == y[2] && x[1] >= y[1] && x[1] <= 1.01 * y[1]) ? 1 : 0}')
  sane_loss "$vt" && [ "$vt" = "$ve" ] && [ "$close" = 1 ] && ok "short_validation_shard (val_loss $vt, estimate $run)" ||
    bad "short_validation_shard (val_loss $vt vs eval $ve, estimate $run vs $est)"
else bad "short_validation_shard (exit $?: $(tail -1 "$S.out"))"; fi

# -- eval and sample from the checkpoint
o=$("$BIN" eval checkpoint="$R/ckpt.bin" data_dir="$D" batch_size=4 threads=2 </dev/null 2>&1); rc=$?
v=$(grep -o '^val_loss [^ ]*' <<<"$o" | cut -d' ' -f2)
[ $rc -eq 0 ] && [ "$(grep -c '^val_loss ' <<<"$o")" = 1 ] && sane_loss "$v" && ok "eval ($v)" || bad "eval (exit $rc: $o)"
# gen KEY=VALUE...: samples 20 tokens after "Once upon a time" from $R's checkpoint; true
# when sample exits 0 and prints the prompt, then text, then one newline. GEN is that text
# (sample stops early at <|endoftext|>, which it does not print, so it may be shorter than 20
# tokens, but every token it prints has at least one byte); GEN_WHY says what went wrong.
# show TEXT: TEXT with every byte but printable ASCII as '?' (a token may be half a UTF-8
# character, and grep takes output that is not valid UTF-8 for binary)
show() { printf '%s' "$1" | LC_ALL=C tr -c ' -~' '?'; }
gen() {
  local p="Once upon a time" o rc
  o=$("$BIN" sample checkpoint="$R/ckpt.bin" prompt="$p" length=20 threads=2 "$@" </dev/null; printf '.%d' $?)
  rc=${o##*.}; o=${o%.*}; GEN=${o#"$p"}; GEN=${GEN%$'\n'}; GEN_WHY="exit $rc: $(show "$o")"
  [ "$rc" = 0 ] && [ "${o#"$p"}" != "$o" ] && [ "${o%$'\n'}" != "$o" ] && [ -n "$GEN" ]
}
# at least one token generated past the echoed prompt, exit status 0
gen seed=1 && ok "sample ($(show "$GEN"))" || bad "sample ($GEN_WHY)"
# the same seed gives the same text; another seed another (at temperature 1 over the whole
# vocabulary, 20 tokens of a barely trained model coincide with negligible probability)
s1=; s1b=; s2=
gen seed=1 temperature=1.0 top_k=0 && s1=$GEN && gen seed=1 temperature=1.0 top_k=0 && s1b=$GEN &&
  gen seed=2 temperature=1.0 top_k=0 && s2=$GEN && [ "$s1" = "$s1b" ] && [ "$s1" != "$s2" ] && ok sample_deterministic ||
  bad "sample_deterministic (seed 1: [$(show "$s1")] then [$(show "$s1b")], seed 2: [$(show "$s2")]; last: $GEN_WHY)"

# -- bad checkpoints: $R/ckpt.bin is the manifest; its one shard is $R/ckpt.bin.s00000030.r0-of-1
expect_exit 2 "cannot open checkpoint" ckpt_missing -- "$BIN" eval checkpoint="$TMP/none.bin" data_dir="$D"
[ "$(cd "$R" && ls ckpt.bin*)" = "$(printf 'ckpt.bin\nckpt.bin.s00000030.r0-of-1\nckpt.bin.s00000030.settings')" ] &&
  grep -q '^{"run":"train",.*"config":{.*"steps":30,' "$R/ckpt.bin.s00000030.settings" && ok ckpt_files || bad "ckpt_files ($(ls "$R"))"
head -c 200 "$R/ckpt.bin" > "$TMP/ck_trunc.bin"
expect_exit 2 "truncated" ckpt_truncated -- "$BIN" eval checkpoint="$TMP/ck_trunc.bin" data_dir="$D"
C=$TMP/ck; mkdir -p "$C"; cp "$R"/ckpt.bin "$R"/ckpt.bin.s*.r0-of-1 "$C"/
SH=$(ls "$C"/ckpt.bin.s*.r0-of-1)
b=$(od -An -tu1 -j4000 -N1 "$SH" | tr -d ' ')  # a byte of tok_embed, past the shard's range table
printf "\\$(printf %o $((b ^ 0x55)))" | dd of="$SH" bs=1 seek=4000 conv=notrunc 2>/dev/null
expect_exit 2 "ckpt.bin.s00000030.r0-of-1 is corrupt \(checksum" ckpt_corrupt -- "$BIN" eval checkpoint="$C/ckpt.bin" data_dir="$D"
head -c 5000 "$R"/ckpt.bin.s*.r0-of-1 > "$SH"
expect_exit 2 "shard .* is truncated" ckpt_shard_truncated -- "$BIN" eval checkpoint="$C/ckpt.bin" data_dir="$D"
rm "$SH"
expect_exit 2 "shard .*ckpt.bin.s00000030.r0-of-1 is missing" ckpt_shard_missing -- "$BIN" sample checkpoint="$C/ckpt.bin"
expect_exit 2 "not a meshtrain checkpoint" ckpt_foreign -- "$BIN" sample checkpoint="$D/train.bin"
expect_exit 2 "embed_dim=64 differs" resume_mismatch -- "$BIN" train resume="$R/ckpt.bin" embed_dim=64 n_heads=2 data_dir="$D" steps=40
expect_exit 2 "nothing to run" resume_done -- "$BIN" train resume="$R/ckpt.bin" data_dir="$D" steps=30

# -- bitwise resume: 8 straight steps, versus a run that dies after its step-4 checkpoint
# (a NaN injected at step 5) and is resumed to step 8: same losses, same final checkpoint.
A=$TMP/a; K=$TMP/k
SCHED="steps=8 lr_schedule=cosine warmup_steps=2 grad_clip=1 progress=false"
"$BIN" train $TINY data_dir="$D" $SCHED out_dir="$A" >/dev/null
MESHTRAIN_FAULT_NAN_STEP=5 "$BIN" train $TINY data_dir="$D" $SCHED ckpt_every=4 out_dir="$K" >/dev/null 2>&1
# the schedule, optimizer, seed and total steps come from the checkpoint
"$BIN" train resume="$K/ckpt.bin" data_dir="$D" progress=false out_dir="$K" >/dev/null
la=$(grep '^{"step":[5-8],"loss"' "$A/log.jsonl" | sed 's/,"ms".*//')
lb=$(grep '^{"step":[5-8],"loss"' "$K/log.jsonl" | sed 's/,"ms".*//')
if [ "$(echo "$la" | wc -l)" -eq 4 ] && [ "$la" = "$lb" ] && cmp -s "$A/ckpt.bin" "$K/ckpt.bin"; then ok resume_bitwise
else bad "resume_bitwise"; echo "$la"; echo "$lb"; fi

# -- a NaN stops the run with exit 1 and leaves the last good checkpoint loadable
N=$TMP/nan
MESHTRAIN_FAULT_NAN_STEP=3 "$BIN" train $TINY data_dir="$D" steps=6 ckpt_every=1 out_dir="$N" progress=false >/dev/null 2>"$TMP/nan.err"
rc=$?
if [ $rc -eq 1 ] && grep -q "NaN" "$TMP/nan.err" && "$BIN" eval checkpoint="$N/ckpt.bin" data_dir="$D" batch_size=4 | grep -q "step 2"
then ok nan_stops_run; else bad "nan_stops_run (exit $rc: $(cat "$TMP/nan.err"))"; fi
ls "$N" | grep -q tmp && bad "nan_no_temp_files" || ok nan_no_temp_files

# -- tests/ckpt_diff -v (for finding where runs that should be alike part): a line per tensor that
# differs (here all of them: step 8 against step 2), none where the checkpoints are alike
dv=$("$DIFF" -v "$A/ckpt.bin" "$N/ckpt.bin"); ds=$("$DIFF" -v "$A/ckpt.bin" "$K/ckpt.bin")
if grep -Eq '^tok_embed.weight: [0-9]+ of [0-9]+ values differ, max_abs_diff [0-9.e-]+, rel_diff' <<<"$dv" &&
   [ "$(grep -c ' values differ' <<<"$dv")" -ge 9 ] && tail -1 <<<"$dv" | grep -Eq '^max_rel_diff [0-9.]+e?-?[0-9]*$' &&
   [ "$(tail -1 <<<"$dv")" != "max_rel_diff 0" ] && [ "$ds" = "max_rel_diff 0" ]
then ok "ckpt_diff_verbose ($(grep -c ' values differ' <<<"$dv") tensors differ)"
else bad "ckpt_diff_verbose ($(head -2 <<<"$dv" | tr '\n' ' ') / $ds)"; fi
# ... and -s (the whole training state, bitwise): nothing differs between the straight and the
# resumed run; against the step-2 checkpoint the counters and each tensor's moments do
sa=$("$DIFF" -s "$A/ckpt.bin" "$K/ckpt.bin"); sn=$("$DIFF" -s "$A/ckpt.bin" "$N/ckpt.bin")
if [ "$sa" = "state_diff 0" ] && grep -qx 'step: 8 against 2' <<<"$sn" && grep -qx 'adam_step: 8 against 2' <<<"$sn" &&
   grep -Eq '^tok_embed.weight m: [0-9]+ of [0-9]+ values differ, max_abs_diff' <<<"$sn" &&
   grep -Eq '^blocks.0.qkv_proj.weight v: [0-9]+ of 3072 values differ' <<<"$sn" &&
   tail -1 <<<"$sn" | grep -Eq '^state_diff [1-9][0-9]*$'
then ok "ckpt_diff_state ($(tail -1 <<<"$sn"))"
else bad "ckpt_diff_state ($sa / $(head -2 <<<"$sn" | tr '\n' ' '))"; fi

# -- estimate: the parameter counts of the post's models
"$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 | grep -q "parameters: 245,566,464" && ok estimate_245M || bad estimate_245M
"$BIN" estimate embed_dim=4096 n_heads=32 n_layers=48 | grep -q "parameters: 7,257,206,784" && ok estimate_7B || bad estimate_7B
"$BIN" estimate embed_dim=1024 n_heads=8 n_layers=16 tie_embeddings=true | grep -q "parameters: 194,103,296" && ok estimate_tied || bad estimate_tied

# -- estimate vs measured max RSS, within 10%, on a run big enough to matter
E=$TMP/est
"$BIN" train vocab_size=50257 embed_dim=128 n_heads=4 n_layers=4 context_len=64 batch_size=16 steps=2 data_dir="$D" out_dir="$E" progress=false > "$TMP/est.out"
rss=$(grep -o '"max_rss_bytes":[0-9]*' "$E/log.jsonl" | cut -d: -f2)
est=$(grep -o '"estimate_bytes":[0-9]*' "$E/log.jsonl" | cut -d: -f2)
if [ -n "${MESHTRAIN_SANITIZED:-}" ]; then :  # ASan's shadow memory: RSS is no measure of the plan
elif [ -n "$rss" ] && [ -n "$est" ] && awk -v r="$rss" -v e="$est" 'BEGIN{d=(e-r)/r; if(d<0)d=-d; exit !(d < 0.10)}'
then ok "estimate_within_10pct (rss $rss, estimate $est)"; else bad "estimate_within_10pct (rss $rss, estimate $est)"; fi

# -- tokenize round trip through the CLI
text='Hello world! <|endoftext|> Ünïcödé 🙂'
ids=$(printf '%s' "$text" | "$BIN" tokenize)
back=$(printf '%s' "$ids" | "$BIN" tokenize decode=true)
[ "$back" = "$text" ] && ok tokenize_round_trip || bad "tokenize_round_trip ($ids -> $back)"
[ "$(printf 'Hello world' | "$BIN" tokenize)" = "15496 995" ] && ok tokenize_ids || bad tokenize_ids
echo "$ids" | grep -qw 50256 && ok tokenize_eot || bad tokenize_eot
expect_exit 2 "out of range" decode_bad_id -- sh -c "echo 99999 | $BIN tokenize decode=true"
# a bad word is quoted alone (not the rest of the input); an id past 64 bits is named as given
expect_exit 2 "^meshtrain: tokenize decode=true: 'abc' is not a token id$" decode_bad_word_alone -- \
  sh -c "printf '15496 abc\n1\n2\n' | $BIN tokenize decode=true"
expect_exit 2 "id 99999999999999999999 is out of range" decode_overflowing_id -- \
  sh -c "echo 99999999999999999999 | $BIN tokenize decode=true"

"$BIN" help | grep -q "embed_dim=1024" && ok help_lists_keys || bad help_lists_keys
# -- the README documents every key and command: each key `meshtrain help` prints is a row
# "| `key` |" of README.md's keys table (its section "### Keys") and each command of help's
# list a row "| `cmd` |" of the Commands table; and the keys table has no row for a key
# help does not print (nor the Commands table for a command it does not list)
section() { awk -v h="$1" '$0 == h {f = 1; next} f && /^#/ {exit} f' README.md; }
rows() { grep -oE '^\| `[a-z_0-9]+` \|' | cut -d'`' -f2 | sort -u; }
help_keys=$("$BIN" help | grep -oE '^  [a-z_0-9]+=' | tr -d ' =' | sort -u)
help_cmds=$("$BIN" help | awk '/^commands:$/ {f = 1; next} f && !NF {exit} f {print $1}' | sort -u)
readme_keys=$(section "### Keys" | rows)
readme_cmds=$(section "## Commands" | rows)
why=""
[ -n "$help_keys" ] && [ -n "$help_cmds" ] || why="$why help lists no keys or no commands;"
m=$(comm -23 <(echo "$help_keys") <(echo "$readme_keys") | paste -sd' '); [ -z "$m" ] || why="$why keys without a row: $m;"
m=$(comm -23 <(echo "$help_cmds") <(echo "$readme_cmds") | paste -sd' '); [ -z "$m" ] || why="$why commands without a row: $m;"
m=$(comm -13 <(echo "$help_keys") <(echo "$readme_keys") | paste -sd' '); [ -z "$m" ] || why="$why rows of keys help does not print: $m;"
m=$(comm -13 <(echo "$help_cmds") <(echo "$readme_cmds") | paste -sd' '); [ -z "$m" ] || why="$why rows of commands help does not list: $m;"
[ -z "$why" ] && ok "readme_documents_every_key ($(echo "$help_keys" | wc -l) keys, $(echo "$help_cmds" | wc -l) commands)" ||
  { why=${why# }; bad "readme_documents_every_key (${why%;})"; }

# -- config=FILE: key=value lines, comments and blank lines, spaces and quotes dropped; the
# command line overrides the file; a bad line is one line naming the file and line, exit 2
cat >"$TMP/recipe.conf" <<EOF2
# a small recipe
$(printf '%s\n' $TINY)
steps = 3
  lr=1e-3
lr_schedule = "cosine"

EOF2
out=$("$BIN" train config="$TMP/recipe.conf" data_dir="$D" steps=2 out_dir="$TMP/rec" 2>&1)
if grep -q '"steps":2,' "$TMP/rec/log.jsonl" 2>/dev/null && grep -q '"lr":0.001,' "$TMP/rec/log.jsonl" &&
   grep -q '"lr_schedule":"cosine"' "$TMP/rec/log.jsonl" &&
   grep -q '"config":".*recipe.conf"' "$TMP/rec/log.jsonl" && [ "$(grep -c '^{"step":[0-9]*,"loss"' "$TMP/rec/log.jsonl")" = 2 ]
then ok config_file_and_override; else bad "config_file_and_override ($(tail -2 <<<"$out"))"; fi
printf 'embed_dim=32\nnosuch=1\n' >"$TMP/bad.conf"
expect_exit 2 "config file .*bad.conf line 2: unknown key 'nosuch'" config_file_bad_key -- "$BIN" train config="$TMP/bad.conf"
printf 'steps=3\nsteps=4\n' >"$TMP/twice.conf"
expect_exit 2 "config file .*twice.conf line 2: key 'steps' given twice" config_file_key_twice -- "$BIN" train config="$TMP/twice.conf"
expect_exit 2 "config=$TMP/nowhere.conf: " config_file_missing -- "$BIN" estimate config="$TMP/nowhere.conf"
# (prompt is not a train key: the file is read for the command it is given to)
printf 'prompt=hi\n' >"$TMP/p.conf"
expect_exit 2 "line 1: key 'prompt' does not apply" config_file_wrong_command -- "$BIN" train config="$TMP/p.conf"
# ... and checkpoints keep the settings of their run beside them, the last checkpoint's only
"$BIN" train $TINY data_dir="$D" steps=3 ckpt_every=1 out_dir="$TMP/sets" >/dev/null
[ "$(cd "$TMP/sets" && ls ckpt.bin*.settings)" = ckpt.bin.s00000003.settings ] && ok ckpt_settings_of_last_only ||
  bad "ckpt_settings_of_last_only ($(ls "$TMP/sets"))"

# -- the hooks (src/env.c): one parser; a malformed value or a misspelt name is one line, exit
# 2, before anything runs; the hooks set are written in the log's first line with the keys
expect_exit 2 "MESHTRAIN_FAULT_NAN_STEP=abc: not an integer" hook_malformed -- env MESHTRAIN_FAULT_NAN_STEP=abc "$BIN" help
expect_exit 2 "MESHTRAIN_PROFILE=yes: expected one of 0\|1\|events" hook_bad_choice -- env MESHTRAIN_PROFILE=yes "$BIN" help
expect_exit 2 "MESHTRAIN_TIMELIN is not a hook .*did you mean MESHTRAIN_TIMELINE" hook_misspelt -- \
  env MESHTRAIN_TIMELIN=3 "$BIN" help
# ... and a variable no longer read is one line saying where its setting went
expect_exit 2 "MESHTRAIN_ZB1_HELD is no longer read: use the key zb1_max_in_flight=" retired_zb1_held -- \
  env MESHTRAIN_ZB1_HELD=5 "$BIN" help
expect_exit 2 "MESHTRAIN_PP_CE is no longer read: use the key pp_copy_engines=" retired_pp_ce -- env MESHTRAIN_PP_CE=0 "$BIN" help
for v in PP_RECV=device INTERLEAVED_LISTS=split ZB1_EXTRA=3; do
  expect_exit 2 "MESHTRAIN_${v%%=*} is no longer read: the alternative it chose was removed" "retired_${v%%=*}" -- \
    env "MESHTRAIN_$v" "$BIN" help
done
MESHTRAIN_TIMELINE=99 "$BIN" train $TINY data_dir="$D" steps=1 out_dir="$TMP/hooklog" >"$TMP/hooklog.out" 2>/dev/null
head -1 "$TMP/hooklog/log.jsonl" | grep -q '"hooks":{"MESHTRAIN_TIMELINE":"99"}' && grep -q "hooks set (environment): MESHTRAIN_TIMELINE=99" "$TMP/hooklog.out" &&
  head -1 "$TMP/hooklog/log.jsonl" | grep -q '"config":{"vocab_size":' && ok hooks_in_log_header ||
  bad "hooks_in_log_header ($(head -c 300 "$TMP/hooklog/log.jsonl"))"

# -- every environment variable the code reads has a row in README's "Environment settings", and
# every variable named there is read somewhere
src_env=$(grep -rhoE '"MESHTRAIN_[A-Z0-9_]+"' src | tr -d '"' | sort -u)
doc_env=$(section "### Environment settings" | grep '^| `MESHTRAIN_' | cut -d'|' -f2 | grep -oE 'MESHTRAIN_[A-Z0-9_]+' | sort -u)
m1=$(comm -23 <(echo "$src_env") <(echo "$doc_env") | paste -sd' '); m2=$(comm -13 <(echo "$src_env") <(echo "$doc_env") | paste -sd' ')
[ "$(echo "$src_env" | wc -l)" -ge 10 ] && [ -z "$m1$m2" ] && ok "readme_documents_every_env ($(echo "$src_env" | wc -l) variables)" ||
  bad "readme_documents_every_env (without a row: ${m1:-none}; rows the code does not read: ${m2:-none})"
echo "RESULT $pass $fail"
