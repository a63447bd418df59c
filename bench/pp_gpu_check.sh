#!/usr/bin/env bash
# Pipeline parallel on NP GPUs follows one GPU (fp32, a tiny model of 8 layers, so that
# pp=4 with interleaving has 2 layers a chunk): every schedule at m = NP and 2 NP, tied and
# untied, each step's loss and the final parameters within 1e-4 (tests/gpu/lib.sh's close).
# (MS="8": only m = 8.) A short check before the pipeline benchmarks; tests/gpu/test_multi_gpu.sh covers pp = 2.
# PP_CE="0 1": each case with send/receive on NCCL's kernels (pp_copy_engines=false) and on
# the copy engines (pp_copy_engines=true; its header must say the copy engines run them), and
# the two runs bitwise alike (the same bytes move); default "1" (the default path).
# Usage: NP=4 PP_CE="0 1" bench/pp_gpu_check.sh   (MESHTRAIN_BIN, default build/meshtrain; DEV=cpu: CPU ranks)
source "$(dirname "$0")/../tests/gpu/lib.sh"
NP=${NP:-4}
M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=8 context_len=64 lr=1e-3 grad_clip=1 steps=5 device=${DEV:-cuda} data_dir=$D precision=fp32 batch_size=16"
for tied in false true; do "$BIN" train $M tie_embeddings=$tied out_dir="$TMP/one_$tied" progress=false >"$TMP/one_$tied.log" 2>&1; done
for sched in ${SCHEDS:-1f1b gpipe zb1 interleaved}; do
  for m in ${MS:-$NP $((2 * NP))}; do
    for tied in false true; do
      for ce in ${PP_CE:-1}; do
        out=$TMP/pp_${sched}_${m}_${tied}_ce$ce
        extra=""; [ $sched = interleaved ] && extra="virtual_stages=2"
        if timeout 120 mpirun --allow-run-as-root --bind-to none --stdin none ${MPI_EXTRA:-} -np "$NP" "$BIN" train $M \
             tie_embeddings=$tied pipeline_parallel_size=$NP micro_batches=$m pipeline_schedule=$sched $extra \
             pp_copy_engines=$ce comm_timeout=60 out_dir="$out" progress=false >"$out.log" 2>&1 &&
           close "$TMP/one_$tied" "$out" &&
           { [ "$ce" = 0 ] || [ "${DEV:-cuda}" != cuda ] || grep -q "^pipeline send/receive: copy engines (" "$out.log"; }
        then ok "pp=$NP $sched m=$m tied=$tied PP_CE=$ce"
        else bad "pp=$NP $sched m=$m tied=$tied PP_CE=$ce ($(grep -m1 '^pipeline send/receive' "$out.log"; tail -2 "$out.log" | tr '\n' ' '))"; fi
        ref=$TMP/pp_${sched}_${m}_${tied}_ce0
        if [ "$ce" != 0 ] && [ -e "$ref/ckpt.bin" ]; then
          d=$("$DIFF" "$ref/ckpt.bin" "$out/ckpt.bin" 2>&1)
          [ "$d" = "max_rel_diff 0" ] && ok "pp=$NP $sched m=$m tied=$tied PP_CE=$ce bitwise PP_CE=0" ||
            bad "pp=$NP $sched m=$m tied=$tied PP_CE=$ce bitwise PP_CE=0 ($d)"
        fi
      done
    done
  done
done
echo "RESULT $pass $fail"
