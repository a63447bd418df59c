#!/usr/bin/env bash
# Do the project's own PyTorch peer (bench/peers/train.py) and the reference program it was
# written against (torch_llama.py, kept beside the project in ../shared/peers) agree, on one
# GPU? For the post's model (embed_dim=1024 n_heads=8 n_layers=16 batch_size=128
# context_len=256), in pure bf16 with compile=1 and in amp=1 (bf16 autocast) with compile=1,
# it runs the two one after the other on the same GPU, steps=10 warmup=3 each (the
# reference's defaults), and prints a table: tokens/s of each and their ratio, the loss at
# step 1 of each (it depends only on the seed, the initial weights, the data and the forward
# pass, so it is equal when the programs agree, bit for bit when the same kernels run), the
# last step's loss, and the peak memory (the allocator's high-water mark over the timed steps).
# Agreement: the same tokens/s within noise, the same step-1 loss. The reference's step-1 loss
# is read by bench/peers/run_ref.py, which runs the reference unchanged.
# Four runs of about a minute each on an H200, most of it compiling.
#
# Usage: bench/peers_agree.sh [REF_DIR]              REF_DIR holds torch_llama.py (default ../shared/peers)
#        CHECK_ONLY=1 bench/peers_agree.sh [REF_DIR]  no GPU needed: the same comparison on the CPU
#            at a tiny size (embed_dim=64 n_heads=4 n_layers=2 batch_size=4 context_len=32
#            vocab=512, eager), in fp32 and in the GPU's two precisions (fp32=0: pure bf16, amp=1);
#            CHECK_COMPILE=1 adds compile=1 (a minute or more per run on a small CPU).
# Environment: RUN_TIMEOUT seconds per run (default 240), STEPS and WARMUP (default 10 and 3),
# CUDA_VISIBLE_DEVICES (default 0: both programs on the same GPU).
set -euo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
REF_DIR=${1:-$here/../../shared/peers}
REF=$REF_DIR/torch_llama.py
CHECK_ONLY=${CHECK_ONLY:-0}
STEPS=${STEPS:-10} WARMUP=${WARMUP:-3} RUN_TIMEOUT=${RUN_TIMEOUT:-240}

die() { echo "peers_agree: $*" >&2; exit 1; }
[ -f "$REF" ] || die "$REF: not found (pass the folder holding the reference programs, e.g. a copy of ../shared/peers)"
[ -f "$here/peers/train.py" ] || die "$here/peers/train.py: not found"
command -v python3 >/dev/null || die "python3: not found"
python3 -c "import torch" 2>/dev/null || die "python3 cannot import torch (pip install torch)"

if [ "$CHECK_ONLY" = 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  CFG="embed_dim=64 n_heads=4 n_layers=2 batch_size=4 context_len=32 vocab=512 device=cpu"
  MODES=("fp32 (CPU)|" "bf16|fp32=0" "amp=1|fp32=0 amp=1")
  [ "${CHECK_COMPILE:-0}" = 1 ] && MODES+=("fp32 compile=1|compile=1")
  where="CPU, tiny config"
else
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    die "no GPU visible to PyTorch (CHECK_ONLY=1 runs the tiny comparison on the CPU)"
  CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256"
  MODES=("bf16 compile=1|compile=1" "amp=1 compile=1|compile=1 amp=1")
  where=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))")
fi
commit=$(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)
torchv=$(python3 -c "import torch; print(torch.__version__)")
echo "peers_agree: $where; torch $torchv; commit $commit; $CFG steps=$STEPS warmup=$WARMUP"
echo "reference: $REF"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# run NAME CMD...: one program; its JSON summary line goes to $out/NAME.json (empty if it failed)
run() {
  local name=$1; shift
  local t0=$SECONDS rc=0
  timeout "$RUN_TIMEOUT" "$@" >"$out/$name.log" 2>&1 || rc=$?
  grep '^{"cfg"' "$out/$name.log" | tail -1 >"$out/$name.json" || true
  if [ ! -s "$out/$name.json" ]; then
    [ "$rc" = 124 ] && echo "  $name: timed out after ${RUN_TIMEOUT}s" >&2 || echo "  $name: failed (exit $rc):" >&2
    tail -15 "$out/$name.log" | sed 's/^/    /' >&2
  else
    echo "  $name: done in $((SECONDS - t0)) s" >&2
  fi
}

rows=()
i=0
for m in "${MODES[@]}"; do
  label=${m%%|*} keys=${m#*|}
  i=$((i + 1))
  echo "$label:" >&2
  # ours first in odd rows, the reference first in even ones: neither always gets the warmer card
  for who in $([ $((i % 2)) = 1 ] && echo "ours ref" || echo "ref ours"); do
    # shellcheck disable=SC2086
    case $who in
    ours) run "ours$i" python3 "$here/peers/train.py" $CFG $keys steps="$STEPS" warmup="$WARMUP" ;;
    ref) run "ref$i" python3 "$here/peers/run_ref.py" "$REF" $CFG $keys steps="$STEPS" warmup="$WARMUP" ;;
    esac
  done
  rows+=("$label|$out/ours$i.json|$out/ref$i.json")
done

python3 - "${rows[@]}" <<'EOF'
import json, sys

def load(path):
    try:
        return json.loads(open(path).read())
    except (OSError, ValueError):
        return None

def num(d, k, fmt):
    return format(d[k], fmt) if d and d.get(k) is not None else "failed"

print()
print("| run | ours tokens/s | reference tokens/s | ours / reference | ours step-1 loss | reference step-1 loss"
      " | step 1 | ours last loss | reference last loss | ours peak GB | reference peak GB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
bad = 0
for row in sys.argv[1:]:
    label, po, pr = row.split("|")
    o, r = load(po), load(pr)
    ratio = f"{o['tokens_per_s'] / r['tokens_per_s']:.3f}" if o and r and r["tokens_per_s"] else "-"
    if o and r and o.get("loss_step1") is not None and r.get("loss_step1") is not None:
        a, b = o["loss_step1"], r["loss_step1"]
        same = "bitwise" if a == b else f"differ {abs(a - b) / abs(b):.1e}"
        bad += a != b
    else:
        same, bad = "-", bad + 1
    print(f"| {label} | {num(o, 'tokens_per_s', ',')} | {num(r, 'tokens_per_s', ',')} | {ratio} | "
          f"{num(o, 'loss_step1', '.7f')} | {num(r, 'loss_step1', '.7f')} | {same} | "
          f"{num(o, 'loss', '.7f')} | {num(r, 'loss', '.7f')} | {num(o, 'peak_mem_gb', '.2f')} | {num(r, 'peak_mem_gb', '.2f')} |")
print()
print("step-1 losses: all equal" if not bad else f"step-1 losses: {bad} row(s) not equal or missing")
sys.exit(1 if bad else 0)
EOF
