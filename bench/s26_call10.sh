#!/usr/bin/env bash
# Session 26, call 10 (one H200): rmsnorm's backward with more, shorter blocks at small N
# (cuda_rmsnorm_blocks fills 512 blocks down to 4 rows a block): the op alone at N = 1024,
# 4096, 8192, 32768 before (OLD) and after (NEW), the op tests, and the post's step at
# micro-batches of 4 and 32 sequences, before and after, alternating.
# Usage: bench/s26_call10.sh OLD NEW   (build folders: meshtrain, bench/bench_ops_cuda; NEW also tests/)
set -u
OLD=$1 NEW=$2
for b in 4 16 32 128; do
  for v in OLD NEW; do
    d=${!v}; ob=$OLD/bench/bench_ops_cuda; [ $v = NEW ] && ob=$NEW/bench/bench_ops_cuda
    printf 'B=%-4s %s ' $b $v; BENCH_OPS=rms timeout 60 $ob mixed 1024 8 $b 256 | tail -1
  done
done
timeout 120 $NEW/tests/gpu_test_ops_cuda 2>&1 | grep -E "^(ok|FAIL)|RESULT|rmsnorm backward" | head -40
[ -s data/tinystories/train.bin ] || $NEW/meshtrain prepare > /dev/null
. bench/lib.sh
POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 device=cuda precision=mixed"
for r in 1 2; do
  for cfg in "batch_size=4 grad_accum_steps=32" "batch_size=32 grad_accum_steps=4"; do
    for v in OLD NEW; do
      BIN=${!v}/meshtrain
      out=$(mktemp -d)
      d=$(MT_TIMEOUT=60 mt_run "$out" 1 "" $POST $cfg steps=21 log_every=20 progress=false ckpt_path=none val_batches=1)
      printf '%-36s %s round %d %9.0f tokens/s\n' "$cfg" $v $r "$(field tokens_per_s "$d")"
    done
  done
done
