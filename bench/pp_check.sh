# Pipeline parallel on 4 GPUs in one run: the schedules agree on 2 GPUs (fp32, a tiny model:
# 1F1B against interleaved and zb1 by ckpt_diff) and exit, then every schedule at pp=4, m=8 and
# m=32 (bench/gpu_pipeline.sh, no peer), tokens/s against the bubble's prediction.
# Usage: OUT=DIR bash bench/pp_check.sh   (from the repository root: build/meshtrain, build/tests/ckpt_diff)
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MT_TIMEOUT=90
O=$OUT; t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
[ -s data/tinystories/train.bin ] || build/meshtrain prepare >/dev/null
stamp sanity
for s in 1f1b interleaved zb1; do
  timeout 40 mpirun --allow-run-as-root -np 2 build/meshtrain train vocab_size=50257 embed_dim=64 n_heads=4 n_layers=4 context_len=64 \
    batch_size=8 steps=5 device=cuda precision=fp32 pipeline_parallel_size=2 micro_batches=4 pipeline_schedule=$s \
    comm_timeout=30 progress=false out_dir=/tmp/s_$s > $O/sanity_$s.log 2>&1; echo "$s rc=$? $(grep -o '"loss":[0-9.]*' /tmp/s_$s/log.jsonl | tail -1)"
done
build/tests/ckpt_diff /tmp/s_1f1b/ckpt.bin /tmp/s_interleaved/ckpt.bin; build/tests/ckpt_diff /tmp/s_1f1b/ckpt.bin /tmp/s_zb1/ckpt.bin
stamp pp4
NP=4 MS="8 32" SCHEDS="1f1b zb1 interleaved gpipe" PEER_MS=" " bench/gpu_pipeline.sh build-peers > $O/pp4.log 2>&1
grep "^|\|failed" $O/pp4.log
stamp done
