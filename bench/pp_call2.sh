# Issue 18 on 4 GPUs, one call (session 13): the schedules agree on 2 GPUs, every schedule at
# pp=4 m=8 with the peer (1F1B compiled), the post's 256-token run with our attention and
# cuDNN's, the 7.26B layouts, the peer's interleaved schedule compiled.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MT_TIMEOUT=100
O=$OUT; t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
[ -s data/tinystories/train.bin ] || build/meshtrain prepare >/dev/null
stamp sanity
for s in 1f1b interleaved zb1; do
  timeout 60 mpirun --allow-run-as-root -np 2 build/meshtrain train vocab_size=50257 embed_dim=64 n_heads=4 n_layers=4 context_len=64 \
    batch_size=8 steps=5 device=cuda precision=fp32 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=$s \
    comm_timeout=30 progress=false out_dir=/tmp/s_$s > $O/sanity_$s.log 2>&1; echo "$s rc=$? $(grep -o '"loss":[0-9.]*' /tmp/s_$s/log.jsonl | tail -1)"
done
build/tests/ckpt_diff /tmp/s_1f1b/ckpt.bin /tmp/s_interleaved/ckpt.bin; build/tests/ckpt_diff /tmp/s_1f1b/ckpt.bin /tmp/s_zb1/ckpt.bin
stamp pp4
NP=4 MS=8 SCHEDS="1f1b zb1 interleaved gpipe" PEER_MS=8 PEER_SCHEDS="1f1b" bench/gpu_pipeline.sh build-peers > $O/pp4.log 2>&1
grep "^|\|failed\|^    " $O/pp4.log
stamp post
. bench/lib.sh; BIN=build/meshtrain
for a in own auto; do
  out=$(mktemp -d)
  d=$(CUDA_VISIBLE_DEVICES=0 mt_run "$out" 1 "" embed_dim=1024 n_heads=8 n_layers=16 context_len=256 \
      batch_size=128 device=cuda steps=21 log_every=20 progress=false ckpt_path=none val_batches=1 attention=$a)
  echo "post 256 mixed attention=$a: $(field tokens_per_s "$d") tokens/s, mfu $(field mfu "$d"), peak $(field gpu_peak_alloc_bytes "$d")"
done
stamp big
MT_TIMEOUT=120 LAYOUTS="pp4 fsdp4 pp2dp2" bench/gpu_7b_layouts.sh > $O/big.log 2>&1
grep "^|\|^    " $O/big.log
stamp peer-il
NP=4 SCHEDS=" " MS=" " PEER_MS=8 PEER_SCHEDS="interleaved" bench/gpu_pipeline.sh build-peers > $O/peer_il.log 2>&1
grep "^| peer" $O/peer_il.log
stamp done
