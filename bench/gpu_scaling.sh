#!/usr/bin/env bash
# Data-parallel scaling of meshtrain AND of the PyTorch peer, in one run on one machine:
# each on one GPU and on NP GPUs (meshtrain DDP through mpirun, the peer through torchrun),
# at the post's configuration per GPU, for both pairs (meshtrain bf16 vs the peer's
# compile=1; meshtrain mixed vs compile=1 amp=1). Both run STEPS timed steps (meshtrain
# excludes its first step; the peer runs 3 warm-up steps first), long enough for the cards
# to reach their sustained (power-limited) clocks: 10-step runs flatter scaling.
# Usage: NP=4 STEPS=60 bench/gpu_scaling.sh [peer.py]    PAIRS="bf16 mixed" picks pairs;
# SIDES="meshtrain peer" picks the systems (SIDES=meshtrain skips the peer's compile time).
# ONE_ALL=1 (the default; ONE_ALL=0: GPU 0 alone) runs each one-GPU case on every GPU at
# once (independent runs) and adds the scaling against their mean and against the slowest:
# DDP cannot outrun its slowest card, and the cards of one machine can differ by a few
# percent. CLOCKS=1 adds, after the table, the cards' median SM clock, power and
# temperature while busy during each run.
set -u
PEER=${1:-../shared/peers/torch_llama.py}
NP=${NP:-4}
STEPS=${STEPS:-60}
BIN=${MESHTRAIN_BIN:-build/meshtrain}
CFG="embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256"
. "$(dirname "$0")/lib.sh"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null

mt() {  # mt NPROC KEYS... -> "tokens/s peakGB"
  local np=$1; shift
  local out d; out=$(mktemp -d)
  d=$(mt_run "$out" "$np" "" $CFG "$@" device=cuda steps=$((STEPS + 1)) log_every=$STEPS progress=false \
      ckpt_path=none val_batches=1)
  [ -n "$d" ] || { echo "meshtrain failed: $(mt_failed "$out")" >&2; echo "0 0"; return; }
  awk -v t="$(field tokens_per_s "$d")" -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{printf "%.0f %.1f", t, m/1e9}'
}
peer() {  # peer NPROC KEYS... -> "tokens/s peakGB"
  local np=$1; shift
  local j; j=$(peer_run "$np" $CFG "$@" steps=$STEPS warmup=3)
  [ -n "$j" ] || { echo "peer failed" >&2; echo "0 0"; return; }
  echo "$(field tokens_per_s "$j") $(field peak_mem_gb "$j")"
}

one() {  # one FUNC KEYS... -> "tokens/s peakGB [mean slowest]": FUNC on GPU 0 (ONE_ALL=1: on each GPU at once)
  local f=$1; shift
  [ "${ONE_ALL:-1}" = 1 ] || { "$f" 1 "$@"; return; }
  local d g pids=(); d=$(mktemp -d)
  for ((g = 0; g < NP; g++)); do CUDA_VISIBLE_DEVICES=$g "$f" 1 "$@" >"$d/$g" & pids+=($!); done
  wait "${pids[@]}"
  echo "$(cat "$d/0") $(for ((g = 0; g < NP; g++)); do cat "$d/$g"; echo; done | mean_min)"
}

CLK=$(mktemp)
clk() {  # clk LABEL FUNC ARGS...: FUNC's output; with CLOCKS=1 the cards' clocks meanwhile go to CLK
  local l=$1; shift
  [ "${CLOCKS:-0}" = 1 ] || { "$@"; return; }
  local f; f=$(mktemp); smi_start "$f"; "$@"; smi_stop
  echo "$l:$(smi_summary "$f")" >>"$CLK"
}

all=""; [ "${ONE_ALL:-1}" = 1 ] && all=" vs the GPUs' mean / the slowest |"
echo "| run ($card, $STEPS steps) | 1 GPU tokens/s | $NP GPUs tokens/s | scaling | peak GB per GPU ($NP GPUs) |$all"
echo "|---|---|---|---|---|${all:+---|}"
row() {  # row LABEL "t1 m1 [mean slowest]" "tn mn"
  read -r t1 _ c w <<<"$2"; read -r tn mn <<<"$3"
  awk -v l="$1" -v a="$t1" -v b="$tn" -v n="$NP" -v m="$mn" -v c="${c:-0}" -v w="${w:-0}" \
    'BEGIN{printf "| %s | %.0f | %.0f | %.1f%% | %s |", l, a, b, (a > 0 ? 100*b/(n*a) : 0), m
           if (c > 0 && w > 0) printf " %.1f%% / %.1f%% |", 100*b/(n*c), 100*b/(n*w); printf "\n"}'
}
for pair in ${PAIRS:-bf16 mixed}; do
  if [ "$pair" = bf16 ]; then pk="compile=1"; else pk="compile=1 amp=1"; fi
  [[ " ${SIDES:-meshtrain peer} " == *" meshtrain "* ]] &&
    row "meshtrain precision=$pair" "$(clk "meshtrain $pair, 1 GPU" one mt precision=$pair)" \
      "$(clk "meshtrain $pair, $NP GPUs" mt "$NP" precision=$pair)"
  [[ " ${SIDES:-meshtrain peer} " == *" peer "* ]] &&
    row "peer $pk" "$(clk "peer $pk, 1 GPU" one peer $pk)" "$(clk "peer $pk, $NP GPUs" peer "$NP" $pk)"
done
[ -s "$CLK" ] && { echo; echo "clocks while busy (median MHz/W/C per GPU):"; cat "$CLK"; }
