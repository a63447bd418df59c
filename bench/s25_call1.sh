#!/usr/bin/env bash
# Session 25, call 1 (one H200): issue 20's attention table, the step against the compiled peer
# at 256 x 128 and 4096 x 8, and where the 4096 x 8 step goes (MESHTRAIN_PROFILE=1).
# Usage: bench/s25_call1.sh BUILD OUTDIR
set -u
B=$1 O=$2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
timeout 200 bash bench/attn_hopper.sh $B 128:8:256:128 32:8:1024:128 8:8:4096:128 2:8:10000:128 8:16:4096:64 16:16:1024:128 8:8:4096:96 16:4:4096:256 > $O/attn.log 2>&1
tail -14 $O/attn.log
[ -s data/tinystories/train.bin ] || $B/meshtrain prepare > /dev/null
MESHTRAIN_PROFILE=1 timeout 60 $B/meshtrain train embed_dim=1024 n_heads=8 n_layers=16 batch_size=8 context_len=4096 device=cuda precision=bf16 steps=6 ckpt_path=none val_batches=1 progress=false > $O/prof.log 2>&1
MESHTRAIN_BIN=$B/meshtrain CONTEXTS="4096:8 256:128" MESHTRAIN_POST_RUNS=bf16 PEER_RUNS=compile STEPS=20 timeout 330 bash bench/gpu_long_context.sh build-peers/torch_llama.py > $O/long.log 2>&1
grep -E "^\||MFU|^==" $O/long.log
