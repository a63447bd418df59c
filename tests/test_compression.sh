#!/usr/bin/env bash
# Gradient compression (grad_compression=bf16|int8|powersgd, error feedback) on 2 CPU ranks
# of DDP (and ZeRO-2, hybrid FSDP): the losses stay near the uncompressed run's, PowerSGD at
# full rank follows it; the bytes each step sends (the log's
# comm_bytes) are the analytic count of the compressed exchanges, and half (bf16) of the
# uncompressed all-reduce's; each rank's residuals are saved beside the checkpoint and a
# resume continues bitwise; a resume on another layout starts them at zero and says so;
# bad values are one line and exit 2. (The error-feedback identity: build/tests/test_compress.)
TEST_NAME=compression
source "$(dirname "$0")/lib.sh"
use_mpirun
prepare_data 300000

# tied: the embedding's gradient is reduced whole (no rows path); one collective a unit
M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 tie_embeddings=true batch_size=4 bucket_mb=0 data_dir=$D"
losses() { grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$1/log.jsonl" | cut -d: -f3; }
bytes() { grep -o '"comm_bytes":[0-9]*' "$1/log.jsonl" | head -1 | cut -d: -f2; }
near() {  # near A B TOL: every step's loss within TOL relative
  paste <(losses "$1") <(losses "$2") | awk -v t="$3" '{d=($1-$2)/$1; if (d<0) d=-d; if (d>t) bad=1; n++} END{exit bad || n < 5}'
}
for k in none bf16 int8; do
  $MPIRUN -np 2 "$BIN" train $M grad_compression=$k out_dir="$TMP/$k" >"$TMP/$k.log" 2>&1 || bad "run_$k ($(tail -1 "$TMP/$k.log"))"
done
near "$TMP/none" "$TMP/bf16" 1e-5 && ok bf16_follows_uncompressed || bad "bf16_follows_uncompressed ($(losses "$TMP/bf16" | tr '\n' ' '))"
near "$TMP/none" "$TMP/int8" 1e-3 && ok int8_near_uncompressed || bad "int8_near_uncompressed ($(losses "$TMP/int8" | tr '\n' ' '))"
grep -q "compressed to int8 with error feedback" "$TMP/int8.log" && ok header_says_compressed || bad header_says_compressed

# bytes a step: units of 1,608,224 (the embedding), 2 x 8,768 (the layers) and 32 (the
# output norm) values, each in blocks of half on 2 ranks; uncompressed a ring all-reduce sends
# 4 bytes a value; compressed, a block goes out twice (to the rank reducing it, and its mean
# back): bf16 2 bytes a value, int8 1 and a 4-byte scale per 256
expect=$(awk 'BEGIN {
  split("1608224 8768 8768 32", u); for (i = 1; i <= 4; i++) { b = u[i] / 2; plain += 2 * b * 4; bf += 2 * b * 2;
    i8 += 2 * (b + 4 * int((b + 255) / 256)) }
  print plain, bf, i8 }')
read -r e_none e_bf16 e_int8 <<<"$expect"
[ "$(bytes "$TMP/none")" = "$e_none" ] && [ "$(bytes "$TMP/bf16")" = "$e_bf16" ] && [ "$(bytes "$TMP/int8")" = "$e_int8" ] &&
  [ $((2 * e_bf16)) = "$e_none" ] && ok bytes_counted_are_the_formula ||
  bad "bytes_counted_are_the_formula (none $(bytes "$TMP/none") want $e_none, bf16 $(bytes "$TMP/bf16") want $e_bf16, int8 $(bytes "$TMP/int8") want $e_int8)"

# -- the other strategies: ZeRO-2's reduce-scatter compressed, hybrid FSDP's all-reduce across
# replicas compressed (4 ranks, shard groups of 2), each near the uncompressed run
$MPIRUN -np 2 "$BIN" train $M grad_compression=int8 fsdp=true shard_strategy=grad_op out_dir="$TMP/z2" >"$TMP/z2.log" 2>&1
near "$TMP/none" "$TMP/z2" 1e-3 && grep -q "gradient reduce-scatter: compressed to int8" "$TMP/z2.log" &&
  ok zero2_int8_near_uncompressed || bad "zero2_int8_near_uncompressed ($(grep -m1 meshtrain: "$TMP/z2.log"))"
if ! skip_sanitized "~"; then
  $MPIRUN -np 4 "$BIN" train ${M/batch_size=4/batch_size=2} grad_compression=int8 fsdp=true shard_strategy=hybrid \
    shard_group_size=2 out_dir="$TMP/hy" >"$TMP/hy.log" 2>&1
  near "$TMP/none" "$TMP/hy" 1e-3 && grep -q "all-reduce across replicas: compressed to int8" "$TMP/hy.log" &&
    ok hybrid_int8_near_uncompressed || bad "hybrid_int8_near_uncompressed ($(grep -m1 meshtrain: "$TMP/hy.log"))"
fi

# -- PowerSGD: at full rank with every matrix compressed it follows the plain all-reduce (the
# losses and the reduced gradient's norm within 1e-5; AdamW's first steps, which divide by the
# gradients' own size, make the parameters of rows with almost no gradient differ more); at rank 1 after 2 steps uncompressed it stays near it, and each step sends
# the factors: P (rows x 1) and Q (cols x 1) of every matrix and the vectors (the norms: 5 x 32)
# whole, 4 bytes a value (a ring of two sends each value once)
P="grad_compression=powersgd powersgd_warmup=0 powersgd_rank=64 powersgd_min_compression_rate=0"
$MPIRUN -np 2 "$BIN" train $M $P out_dir="$TMP/psgd_full" >"$TMP/psgd_full.log" 2>&1
near "$TMP/none" "$TMP/psgd_full" 1e-5 && same_norms "$TMP/none" "$TMP/psgd_full" && ok powersgd_full_rank_follows_allreduce ||
  bad "powersgd_full_rank_follows_allreduce ($(grep -m1 meshtrain: "$TMP/psgd_full.log"))"
$MPIRUN -np 2 "$BIN" train $M grad_compression=powersgd powersgd_warmup=2 out_dir="$TMP/psgd" >"$TMP/psgd.log" 2>&1
near "$TMP/none" "$TMP/psgd" 1e-3 && ok powersgd_rank1_near_uncompressed || bad "powersgd_rank1_near_uncompressed ($(losses "$TMP/psgd" | tr '\n' ' '))"
# matrices [rows, cols]: tok_embed 50257 x 32; a layer's qkv 96 x 32, att_out 32 x 32, gate and up 48 x 32, down 32 x 48
want=$(( 4 * (50257 + 32 + 2 * (96 + 32 + 32 + 32 + 48 + 32 + 48 + 32 + 32 + 48) + 5 * 32) ))
grep -o '"comm_bytes":[0-9]*' "$TMP/psgd/log.jsonl" | cut -d: -f2 | tr '\n' ' ' |
  awk -v plain="$e_none" -v want="$want" '{exit !($1 == plain && $2 == plain && $3 == want && $5 == want)}' &&
  ok powersgd_bytes_after_warmup || bad "powersgd_bytes_after_warmup ($(grep -o '"comm_bytes":[0-9]*' "$TMP/psgd/log.jsonl" | cut -d: -f2 | tr '\n' ' ') want $e_none twice then $want)"
$MPIRUN -np 2 "$BIN" train ${M/steps=5/steps=3} lr_decay_steps=5 grad_compression=powersgd powersgd_warmup=2 \
  out_dir="$TMP/psgd_part" >/dev/null 2>&1
$MPIRUN -np 2 "$BIN" train $M grad_compression=powersgd powersgd_warmup=2 resume="$TMP/psgd_part/ckpt.bin" \
  out_dir="$TMP/psgd_res" >"$TMP/psgd_res.log" 2>&1
"$DIFF" "$TMP/psgd_res/ckpt.bin" "$TMP/psgd/ckpt.bin" | grep -qx 'max_rel_diff 0' && ok powersgd_resume_bitwise ||
  bad "powersgd_resume_bitwise ($("$DIFF" "$TMP/psgd_res/ckpt.bin" "$TMP/psgd/ckpt.bin" 2>&1; tail -1 "$TMP/psgd_res.log"))"

# -- the residuals are saved, each rank's, and a resume continues bitwise
[ -s "$TMP/int8/ckpt.bin.s00000005.ef0" ] && [ -s "$TMP/int8/ckpt.bin.s00000005.ef1" ] && ok residuals_saved_per_rank ||
  bad residuals_saved_per_rank
$MPIRUN -np 2 "$BIN" train ${M/steps=5/steps=3} lr_decay_steps=5 grad_compression=int8 out_dir="$TMP/part" >/dev/null 2>&1
$MPIRUN -np 2 "$BIN" train $M grad_compression=int8 resume="$TMP/part/ckpt.bin" out_dir="$TMP/res" >"$TMP/res.log" 2>&1
"$DIFF" "$TMP/res/ckpt.bin" "$TMP/int8/ckpt.bin" | grep -qx 'max_rel_diff 0' && cmp -s "$TMP/res/ckpt.bin.s00000005.ef1" "$TMP/int8/ckpt.bin.s00000005.ef1" &&
  ok resume_bitwise || bad "resume_bitwise ($("$DIFF" "$TMP/res/ckpt.bin" "$TMP/int8/ckpt.bin" 2>&1; tail -1 "$TMP/res.log"))"
ls "$TMP/res" | grep -q 's00000003.ef' && bad older_residuals_removed || ok older_residuals_removed
# on another layout (one process: nothing to compress) the run goes on and says what it dropped
if "$BIN" train ${M/batch_size=4/batch_size=8} grad_compression=int8 resume="$TMP/part/ckpt.bin" out_dir="$TMP/res1" \
     >"$TMP/res1.log" 2>&1 && [ -s "$TMP/res1/ckpt.bin" ]; then ok resume_in_one_process
else bad "resume_in_one_process ($(tail -1 "$TMP/res1.log"))"; fi
printf 'garbage' >"$TMP/part/ckpt.bin.s00000003.ef1"
err=$($MPIRUN -np 2 "$BIN" train $M grad_compression=int8 resume="$TMP/part/ckpt.bin" out_dir="$TMP/resc" 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && grep -q "ef1.*corrupt" <<<"$err" && ok corrupt_residuals_refused || bad "corrupt_residuals_refused (exit $rc)"

# -- bad values
expect_exit 2 "grad_compression=powersgd compresses an all-reduce: DDP only" powersgd_with_fsdp -- \
  "$BIN" train $M grad_compression=powersgd fsdp=true out_dir="$TMP/bad1"
expect_exit 2 "grad_compression" unknown_kind -- "$BIN" train $M grad_compression=fp4 out_dir="$TMP/bad3"
expect_exit 2 "powersgd_rank applies to grad_compression=powersgd" powersgd_key_alone -- \
  "$BIN" train $M grad_compression=int8 powersgd_rank=2 out_dir="$TMP/bad4"

echo "RESULT $pass $fail"
[ "$fail" -eq 0 ]
