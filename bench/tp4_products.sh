#!/usr/bin/env bash
# A tp=4 rank's matrix products on the TP-efficiency model (embed 4096, 32 heads, FFN 6144,
# context 4096, batch 1, bf16): each whole (4096 rows) and as one block of 1024 rows (what the
# fused sums and gathers run, four a product), each call synchronised and then queued back to
# back (BENCH_QUEUED=1, as a step queues them). Per shape "n,c,oc": fwd is the forward product
# (qkv, gate_up: after a gather; att_out, down: before a sum), dinp the backward's input
# gradient (qkv, gate_up: before a sum; att_out, down: after a gather, narrow outputs of 1024
# and 1536 columns), dw the weight gradient (always whole). One GPU.
# Usage: bash bench/tp4_products.sh [bench_ops_cuda]
B=${1:-build/bench/bench_ops_cuda}
S="4096,4096,3072;1024,4096,3072;4096,1024,4096;1024,1024,4096;4096,1536,4096;1024,1536,4096"
for q in 0 1; do BENCH_QUEUED=$q BENCH_SHAPES="$S" "$B" bf16 4096 32 1 4096; done
