#!/usr/bin/env bash
# What issues 18 and 19 still need from a 2- or 4-GPU machine, as device calls of under ten
# minutes each, in the order to run them (written in session 27, after four sessions lent one
# GPU only). Each call prints what bench/RESULTS.md needs; the scripts it runs say the rest.
#   1  (4 GPUs, or 2)  tests/gpu/test_multi_gpu.sh: every multi-GPU case, the layer-graph ones new
#   2  (4 GPUs)        pipeline and tensor-parallel checks on 4 GPUs (pp_gpu_check, tp_layouts_check:
#                      tp 2 beside pp 2 and dp 2 on the fused sums)
#   3  (4 GPUs, or 2)  issue 18: the send/receive time not hidden by compute, every schedule at pp 4
#                      (pp 2 on two GPUs; pp_exposed: the same runs with and without the copies)
#   4  (2 GPUs, or 4)  issue 18: pp 2, m 32, interleaved and zb1 beside the peer's interleaved and zbv
#                      (the pairs session 24 ran out of time for), then layer graphs on pp 2
#   5  (4 GPUs)        layer graphs on pp 4 at m 8 and 32: if they win, graphs_wanted's default for
#                      several processes flips (src/train/train.c, README "Layer graphs")
# Usage: bash bench/multi_gpu_next.sh CALL BUILD [PEERS]   (BUILD holds meshtrain and tests/ckpt_diff;
#        PEERS a copy of ../shared/peers; run from the repository root with data/ prepared)
set -u
call=${1:?call number 1-5} B=${2:?build folder} P=${3:-build-peers}
here=$(dirname "$0")
n=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "call $call: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $n, $(git log -1 --format=%h 2>/dev/null)"
np4() { [ "$n" -ge 4 ] || { echo "call $call needs 4 GPUs ($n here)"; exit 2; }; }
case $call in
1) MESHTRAIN_BIN=$B/meshtrain timeout 580 bash tests/gpu/test_multi_gpu.sh 2>&1 | grep -v "^  " | tail -120 ;;
2) np4
   NP=4 MS=8 MESHTRAIN_BIN=$B/meshtrain timeout 240 bash "$here/pp_gpu_check.sh" 2>&1 | grep -E "^ok|^FAIL|RESULT"
   MESHTRAIN_BIN=$B/meshtrain timeout 320 bash "$here/tp_layouts_check.sh" 2>&1 | grep -E "^ok|^FAIL|RESULT" ;;
3) NP=$((n >= 4 ? 4 : 2)) M=8 REPS=2 timeout 580 bash "$here/pp_exposed.sh" "$B/meshtrain" 2>&1 | tail -20 ;;
4) NP=2 MS=32 STEPS=10 SCHEDS="interleaved zb1" PEER_SCHEDS="interleaved zbv" PEER_MS=32 BIN=$B/meshtrain \
     timeout 400 bash "$here/gpu_pipeline.sh" "$P" 2>&1 | tail -16
   NP=2 MS=8 SCHEDS="1f1b zb1" BIN=$B/meshtrain timeout 170 bash "$here/pp_graphs_ab.sh" 2>&1 | tail -14 ;;
5) np4
   NP=4 MS="8 32" SCHEDS="1f1b interleaved zb1" BIN=$B/meshtrain timeout 580 bash "$here/pp_graphs_ab.sh" 2>&1 | tail -30 ;;
*) echo "call $call: 1-5"; exit 2 ;;
esac
