#!/usr/bin/env bash
# Causal attention on one GPU, forward and backward apart: meshtrain's op under each choice of the
# keys attention and deterministic (bench_attn: own = attention=own; cudnn = attention=cudnn
# deterministic=false; cudnn-det = attention=cudnn, its deterministic backward engine; auto = the
# default, our Hopper backward where it takes it; fast = deterministic=false, that kernel's atomic
# dQ), beside PyTorch's SDPA on its flash and cuDNN backends (attn_torch.py), at bench_attn's
# shapes, in one run on the same card.
# Usage (from the repository root): bench/attn_hopper.sh [BUILD] [B:H:T:D ...]
#   BUILD: the build folder holding bench/bench_attn (default build; `make BUILD=... bench`).
# Prints each program's lines, then a table of TFLOP/s (causal FLOPs: 4 B H T^2 D / 2 forward,
# 2.5x that backward). libcudnn.so.9 is found on the loader's path, else the one PyTorch ships
# (MESHTRAIN_CUDNN_LIB names it); PYTHON picks the interpreter (default python3).
set -u
build=${1:-build}
[ $# -gt 0 ] && shift
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "${MESHTRAIN_CUDNN_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcudnn\.so\.9 '; then
  lib=$("$py" - <<'PY' 2>/dev/null
import glob, os
import nvidia.cudnn as m
for d in m.__path__:
    for f in glob.glob(os.path.join(d, "**", "libcudnn.so.9"), recursive=True):
        print(f); raise SystemExit
PY
)
  [ -n "$lib" ] && export MESHTRAIN_CUDNN_LIB=$lib && echo "info libcudnn: $lib"
fi
out=$(mktemp)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader 2>/dev/null | sed 's/^/info gpu: /'
"$build/bench/bench_attn" "$@" | tee -a "$out"
"$py" "$here/attn_torch.py" "$@" 2>&1 | tee -a "$out"
"$py" - "$out" <<'PY'
import sys
rows, res = [], {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 10 and f[0] == "RESULT":
        key = tuple(int(x) for x in f[3:7])
        if key not in rows: rows.append(key)
        res[(f[1], f[2], key, f[9])] = float(f[8])
impls = ["own", "cudnn", "cudnn-det", "auto", "fast", "torch-flash", "torch-cudnn"]
for how, what in (("loop", "back-to-back calls"), ("events", "each call between CUDA events after an L2 flush, as do_bench")):
    for d in ("fwd", "bwd"):
        print(f"\nTFLOP/s, {d} (causal FLOPs), timed by {what}")
        print(f"{'B x H x T, D':>22} " + " ".join(f"{i:>12}" for i in impls))
        for k in rows:
            cells = [res.get((i, d, k, how)) for i in impls]
            print(f"{'%d x %d x %d, %d' % k:>22} " + " ".join(f"{c:12.1f}" if c is not None else f"{'-':>12}" for c in cells))
PY
rm -f "$out"
