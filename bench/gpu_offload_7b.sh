#!/usr/bin/env bash
# The post's 7.26B model on ONE GPU with offload=optimizer: the fp32 master weights,
# AdamW's moments and a bf16 copy of the gradients in pinned host memory, updated on the CPU
# cores; the GPU keeps the bf16 weights, the fp32 gradients (accumulated over K micro-batches)
# and the activations (checkpointed). Target: MFU >= 35% with K large enough that the host's
# update hides under the GPU's work.
#
# 1. sanity (small, ~1 min): the post's model (E1024 H8 L16), precision=mixed, 20 steps with
#    offload=optimizer and without: the losses must follow each other (bf16 gradients on the
#    host round differently from the device's fp32 update: close, not bitwise).
# 2. the estimate of the 7.26B run, and the run itself: STEPS steps (the first excluded from
#    tokens/s), each K micro-batches of B sequences. Prints tokens/s, MFU, the GPU's peak
#    against the estimate (within 5% expected), host max RSS against the pinned estimate, and
#    per step the host update's time and how long the forward waited for it.
# Usage: bench/gpu_offload_7b.sh [meshtrain]   (B=8 K=32 STEPS=3; SANITY=0 skips part 1,
# BIG=0 part 2; MT_TIMEOUT=s caps each run). Part 2 takes a few minutes: the init and pinning
# ~95 GiB of host memory come first, and each step is K micro-batches.
set -u
BIN=${1:-build/meshtrain} B=${B:-8} K=${K:-32} STEPS=${STEPS:-3}
. "$(dirname "$0")/lib.sh"
echo "card: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); host: $(nproc) cores," \
  "$(awk '/MemTotal/ {printf "%.1f GiB total", $2 / 1048576} /MemAvailable/ {printf ", %.1f GiB available", $2 / 1048576}' /proc/meminfo)"
[ -s data/tinystories/train.bin ] || "$BIN" prepare >/dev/null

if [ "${SANITY:-1}" != 0 ]; then
  echo "== sanity: the post's model, precision=mixed, 20 steps, offload none vs optimizer"
  POST="embed_dim=1024 n_heads=8 n_layers=16 context_len=256 batch_size=32 device=cuda precision=mixed steps=20"
  POST="$POST log_every=20 progress=false ckpt_path=none val_batches=4 seed=1"
  for off in none optimizer; do
    out=$(mktemp -d); eval "dir_$off=$out"
    d=$(mt_run "$out" 1 "" $POST offload=$off)
    [ -n "$d" ] || { echo "offload=$off: failed: $(mt_failed "$out" 3)"; continue; }
    printf 'offload=%-9s %8.0f tokens/s  loss %s  val_loss %s  peak %s GiB (estimate %s GiB)\n' "$off" \
      "$(field tokens_per_s "$d")" "$(field loss "$d")" "$(field val_loss "$d")" \
      "$(gib "$(field gpu_peak_alloc_bytes "$d")" 2)" "$(gib "$(field estimate_bytes "$d")" 2)"
  done
  # every step's loss: the largest relative difference (bf16 gradients on the host: small, not 0)
  paste <(grep -o '"step":[0-9]*,"loss":[0-9.]*' "$dir_none/log.jsonl" | cut -d: -f3) \
        <(grep -o '"step":[0-9]*,"loss":[0-9.]*' "$dir_optimizer/log.jsonl" | cut -d: -f3) |
    awk 'NF == 2 {d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++}
         END {if (n != 20) print "sanity: FAILED (" n " of 20 steps in both logs)";
              else printf "sanity: %s (largest relative loss difference over 20 steps %.2e; expected < 1e-2)\n",
                          w < 1e-2 ? "ok" : "CHECK", w}'
fi

[ "${BIG:-1}" != 0 ] || exit 0
BIGM="embed_dim=4096 n_heads=32 n_layers=48 context_len=256 device=cuda precision=mixed offload=optimizer"
BIGM="$BIGM activation_checkpointing=true batch_size=$B grad_accum_steps=$K"
echo "== the estimate (meshtrain estimate ${BIGM/grad_accum_steps=$K/}: the estimate has no grad_accum_steps)"
"$BIN" estimate ${BIGM/grad_accum_steps=$K/} | sed -n '/^memory per GPU/,/^by offload/p' | grep -v '^by offload'
echo "== 7.26B, one GPU: $STEPS steps of $K x $B x 256 tokens (the first excluded)"
out=$(mktemp -d)
d=$(mt_run "$out" 1 "" $BIGM steps=$STEPS log_every=1 progress=false ckpt_path=none val_batches=1)
grep -E '^step|^offload:' "$out/stdout"
[ -n "$d" ] || { echo "7.26B run failed: $(mt_failed "$out" 4)"; exit 1; }
P=7257206784
tok=$(field tokens_per_s "$d") peak=$(field gpu_peak_alloc_bytes "$d") est=$(field estimate_bytes "$d")
printf '7.26B B=%s K=%s: %.0f tokens/s, MFU %.1f%% (the run: 6 N + attention FLOPs per token), %.1f%% by 6 N tok/s / 989 TFLOP/s\n' \
  "$B" "$K" "$tok" "$(awk -v m="$(field mfu "$d")" 'BEGIN {print 100 * m}')" \
  "$(awk -v t="$tok" -v P=$P 'BEGIN {print 100 * 6 * P * t / 989e12}')"
awk -v p="$peak" -v e="$est" 'BEGIN {r = p / e; printf "GPU peak %.2f GiB allocated, estimate %.2f GiB (%+.1f%%: %s)\n",
  p / 1073741824, e / 1073741824, 100 * (r - 1), (r > 0.95 && r < 1.05) ? "within 5%" : "OFF BY MORE THAN 5%"}'
printf 'GPU used on the card (context included): %s GiB\n' "$(gib "$(field gpu_peak_used_bytes "$d")" 2)"
printf 'host: max RSS %s GiB, offloaded state estimate %s GiB pinned\n' "$(gib "$(field max_rss_bytes "$d")" 2)" \
  "$(gib "$(field host_estimate_bytes "$d")" 2)"
printf 'host update: %s ms a step on the CPU cores; the forward waited %s ms a step for it (timed steps mean)\n' \
  "$(field host_update_ms "$d")" "$(field update_wait_ms "$d")"
grep '"step":[0-9]*,"loss"' "$out/log.jsonl" | while read -r line; do
  printf '  step %s: %s ms; the last step'"'"'s host update %s ms, waited for %s ms\n' "$(field step "$line")" \
    "$(field ms "$line")" "$(field host_update_ms "$line")" "$(field update_wait_ms "$line")"
done
