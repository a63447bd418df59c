#!/usr/bin/env bash
# Mixed-precision DDP on NP GPUs at the post's configuration with NCCL's default number of
# CTAs and with NCCL_MAX_CTAS capped (fewer SMs taken from the backward while gradients
# all-reduce), against one GPU, 20 steps each. Usage: NP=4 bench/nccl_ctas.sh [caps...]
NP=${NP:-4}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 device=cuda precision=${PREC:-mixed}"
CFG="$CFG steps=20 log_every=10 progress=false ckpt_path=none"
MPI="mpirun --allow-run-as-root --bind-to none --stdin none -np $NP"
echo "1 GPU: $(CUDA_VISIBLE_DEVICES=0 "$BIN" train $CFG out_dir=/tmp/ctas1 | grep '^done' | cut -c1-60)"
echo "DDP $NP, default: $($MPI "$BIN" train $CFG out_dir=/tmp/ctasd 2>&1 | grep '^done' | cut -c1-60)"
for v in "${@:-8 16}"; do
  echo "DDP $NP, NCCL_MAX_CTAS=$v: $(NCCL_MAX_CTAS=$v $MPI -x NCCL_MAX_CTAS "$BIN" train $CFG out_dir=/tmp/ctas$v 2>&1 | grep '^done' | cut -c1-60)"
done
