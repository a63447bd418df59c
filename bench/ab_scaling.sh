#!/usr/bin/env bash
# Data-parallel scaling of several builds side by side, in one run: every spec runs the post's
# configuration on one GPU and as NP-GPU DDP, in each precision of PRECS, REPS rounds, specs
# alternating within a round (so drift of the cards' clocks hits all alike), STEPS timed steps
# each. A spec is a binary, optionally with environment for every rank: BIN or
# BIN@VAR=v,VAR2=w; a leading
# "^" runs it on NP GPUs only, its scaling taken against the first spec's one-GPU runs (for
# changes that cannot touch one GPU's step).
# Usage: NP=4 REPS=2 bench/ab_scaling.sh build-main/meshtrain ^build-x/meshtrain@NCCL_CTA_POLICY=1
# BASE replaces the model and device keys. ONE_ALL=1 runs the one-GPU case on each of the NP
# GPUs at once and also gives the scaling against their mean and against the slowest of
# them (DDP cannot outrun its slowest card). CLOCKS=1 prints after each group of runs the
# cards' median SM clock, power and temperature while busy (MHz/W/C, bench/lib.sh smi_start).
# Prints one line per run (with its median and slowest step; with OUT set, its log goes to
# OUT/logs), then per spec and precision the median tokens/s on 1 and NP GPUs,
# the scaling (NP-GPU tokens/s / (NP x one GPU's)) and the peak memory per GPU.
set -u
STEPS=${STEPS:-60}
NP=${NP:-4}
. "$(dirname "$0")/lib.sh"
CFG="${BASE:-embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 device=cuda}"
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
res=$(mktemp)
for ((r = 1; r <= ${REPS:-2}; r++)); do
  for spec in "$@"; do
    nps="1 $NP" s=$spec
    [ "${s:0:1}" = "^" ] && nps=$NP s=${s:1}
    bin=${s%%@*} envs=""
    [ "$bin" != "$s" ] && envs=${s#*@} && envs=${envs//,/ }
    for prec in ${PRECS:-bf16 mixed}; do
      for np in $nps; do
        # ONE_ALL=1: the one-GPU run on every GPU at once (independent runs), GPU 0's figure
        # as "1" and the mean of all as "m": DDP runs at its slowest card's pace, and the
        # cards of one machine differ by a percent or so
        gpus=0
        [ "$np" = 1 ] && [ "${ONE_ALL:-0}" = 1 ] && gpus=$(seq 0 $((NP - 1)))
        outs=() pids=()
        [ "${CLOCKS:-0}" = 1 ] && smi=$(mktemp) && smi_start "$smi"
        for g in $gpus; do
          o=$(mktemp -d); outs+=("$o")
          (  # DDP: every rank sees all GPUs
            [ "$np" = 1 ] && export CUDA_VISIBLE_DEVICES=$g
            BIN=$bin mt_run "$o" "$np" "$envs" $CFG precision=$prec steps=$((STEPS + 1)) log_every=$STEPS \
              progress=false ckpt_path=none val_batches=1 >"$o/done"
          ) &
          pids+=($!)
        done
        wait "${pids[@]}"
        [ "${CLOCKS:-0}" = 1 ] && smi_stop
        k=0 ts=""
        for o in "${outs[@]}"; do
          d=$(cat "$o/done")
          t=$(field tokens_per_s "$d") m=$(field gpu_peak_alloc_bytes "$d")
          [ -n "$t" ] || { echo "$spec $prec np=$np: failed: $(mt_failed "$o")"; continue 2; }
          # the timed steps' times (step 1 is not timed): median and slowest, in ms
          ms=$(grep -o '"step":[0-9]*,.*"ms":[0-9.]*' "$o/log.jsonl" | awk -F'"ms":' '$0 !~ /"step":1,/ {print $2}' |
               sort -n | awk '{a[NR] = $1} END {if (NR) printf "%.1f / %.1f", a[int((NR + 1) / 2)], a[NR]}')
          tag=$np; [ ${#outs[@]} -gt 1 ] && tag="1@gpu$k"
          printf '%-48s %-6s np=%s round %d %10.0f tokens/s %5.1f GiB  step ms median / max %s\n' "$spec" "$prec" \
            "$tag" "$r" "$t" "$(awk -v m="$m" 'BEGIN{print m/2^30}')" "$ms"
          [ -n "${OUT:-}" ] && mkdir -p "$OUT/logs" &&
            cp "$o/log.jsonl" "$OUT/logs/$(printf '%s-%s-%s-%s' "$spec" "$prec" "$tag" "$r" | tr -c 'a-zA-Z0-9_.-' _).jsonl"
          [ "$k" = 0 ] && echo "$spec $prec $np $t $m" >>"$res"
          ts+="$t"$'\n' k=$((k + 1))
        done
        [ "${CLOCKS:-0}" = 1 ] && printf '%-48s %-6s np=%s round %d clocks MHz/W/C:%s\n' "$spec" "$prec" "$np" "$r" "$(smi_summary "$smi")"
        if [ "$k" -gt 1 ]; then
          read -r mean slow <<<"$(mean_min <<<"$ts")"
          echo "$spec $prec m $mean 0" >>"$res"; echo "$spec $prec s $slow 0" >>"$res"
        fi
      done
    done
  done
done
printf '%-48s %-6s %10s %12s %8s %8s %s\n' spec prec 1-GPU "$NP-GPU" scaling peakGiB "$([ "${ONE_ALL:-0}" = 1 ] && echo "vs the GPUs' mean / the slowest GPU")"
for spec in "$@"; do
  for prec in ${PRECS:-bf16 mixed}; do
    s1=$spec
    [ "${spec:0:1}" = "^" ] && s1=$1
    one=$(awk -v s="$s1" -v p="$prec" '$1 == s && $2 == p && $3 == 1 {print $4}' "$res" | median)
    mean=$(awk -v s="$s1" -v p="$prec" '$1 == s && $2 == p && $3 == "m" {print $4}' "$res" | median)
    slow=$(awk -v s="$s1" -v p="$prec" '$1 == s && $2 == p && $3 == "s" {print $4}' "$res" | median)
    many=$(awk -v s="$spec" -v p="$prec" -v n="$NP" '$1 == s && $2 == p && $3 == n {print $4}' "$res" | median)
    peak=$(awk -v s="$spec" -v p="$prec" -v n="$NP" '$1 == s && $2 == p && $3 == n {print $5}' "$res" | median)
    awk -v s="$spec" -v p="$prec" -v a="${one:-0}" -v b="${many:-0}" -v n="$NP" -v m="${peak:-0}" -v c="${mean:-0}" -v w="${slow:-0}" \
      'BEGIN{printf "%-48s %-6s %10.0f %12.0f %7.1f%% %8.1f", s, p, a, b, a ? 100 * b / (n * a) : 0, m / 2^30
             if (c > 0) printf " %7.1f%% (mean %.0f)", 100 * b / (n * c), c
             if (w > 0) printf " / %.1f%% (slowest %.0f)", 100 * b / (n * w), w; printf "\n"}'
  done
done
