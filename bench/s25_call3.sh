#!/usr/bin/env bash
# Session 25, call 3 (one H200): cuBLASLt's first heuristic choice against the fastest of its
# list at the step's products, and the memory-bound ops queued as a step queues them.
# Usage: bench/s25_call3.sh BUILD OUTDIR
set -u
B=$1 O=$2
timeout 200 $B/bench/lt_algos_probe 2>&1 | tee $O/lt.log
BENCH_OPS=mem BENCH_QUEUED=1 timeout 120 $B/bench/bench_ops_cuda bf16 2>&1 | tee $O/mem.log
