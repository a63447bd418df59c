# Sourced by the GPU benchmark scripts: one way to run meshtrain and the PyTorch peer, and
# to read their result lines. Expects BIN (meshtrain) and, for peer_run, PEER.
MPI="mpirun --allow-run-as-root --bind-to none --stdin none"

# mt_run OUT NPROC ENVS KEYS...: `$BIN train KEYS... out_dir=OUT` on one GPU (the first of
# CUDA_VISIBLE_DEVICES, else GPU 0) or under mpirun -np NPROC, with ENVS (space-separated
# VAR=value, may be empty) set on every rank; its output goes to OUT/stdout. MT_TIMEOUT=s
# ends a run that takes longer (0, the default: no limit). Prints the
# log's "done" line, nothing if the run failed (mt_failed OUT then says why).
mt_run() {
  local out=$1 np=$2 envs=$3; shift 3
  if [ "$np" = 1 ]; then
    timeout "${MT_TIMEOUT:-0}" env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" $envs "$BIN" train "$@" out_dir="$out" \
      >"$out/stdout" 2>&1
  else
    local xs=() e
    for e in $envs; do xs+=(-x "$e"); done
    timeout "${MT_TIMEOUT:-0}" env $envs $MPI -np "$np" "${xs[@]}" "$BIN" train "$@" out_dir="$out" >"$out/stdout" 2>&1
  fi
  grep '"done"' "$out/log.jsonl" 2>/dev/null
}
# mt_failed OUT [LINES]: the last lines of a run's output, on one line
mt_failed() { tail -"${2:-2}" "$1/stdout" | tr '\n' ' '; }
# mt_row NAME NPROC KEYS...: one meshtrain run (mt_run; MT_ENV: its environment settings), printed as one row
# "NAME tokens/s peak GB estimate GB" (the GPU allocator's peak), or why it failed
mt_row() {
  local name=$1 np=$2; shift 2
  local out d; out=$(mktemp -d)
  d=$(mt_run "$out" "$np" "${MT_ENV:-}" "$@")
  [ -n "$d" ] || { echo "$name: failed: $(mt_failed "$out" 3)"; return; }
  printf '%-44s %9.0f tokens/s  peak %5.1f GB  estimate %5.1f GB\n' "$name" "$(field tokens_per_s "$d")" \
    "$(awk -v m="$(field gpu_peak_alloc_bytes "$d")" 'BEGIN{print m/1e9}')" \
    "$(awk -v m="$(field estimate_bytes "$d")" 'BEGIN{print m/1e9}')"
}

# median: the median of the numbers on stdin, one a line (nothing for none)
median() { sort -n | awk '{a[NR] = $1} END {if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}'; }
# mean_min: "MEAN MIN" of the first field of the non-empty lines on stdin (the GPUs' one-GPU
# runs: their mean, and the slowest, whose pace DDP cannot beat); nothing for none
mean_min() { awk 'NF {s += $1; if (!n || $1 < w) w = $1; n++} END {if (n) printf "%.0f %.0f\n", s / n, w}'; }

# gib BYTES [DIGITS]: BYTES in GiB (as the estimate prints them), DIGITS decimals (1)
gib() { awk -v m="${1:-0}" -v d="${2:-1}" 'BEGIN {printf "%." d "f", m / 1073741824}'; }

# field NAME LINE: a number from a JSON line ("k":v as meshtrain writes it, "k": v the peer)
field() { grep -o "\"$1\": *[0-9.e+-]*" <<<"$2" | head -1 | sed 's/.*: *//'; }

# peer_run NPROC KEYS...: the peer under torchrun; prints its JSON result line
peer_run() {
  local np=$1; shift
  torchrun --standalone --nproc_per_node="$np" "$PEER" "$@" 2>&1 | grep '^{' | tail -1
}

# smi_start FILE: samples every GPU's SM clock, power, utilization and temperature each
# 100 ms into FILE, in the background, until smi_stop; smi_summary FILE prints, per GPU,
# the medians over the samples where it was busy (utilization >= 95%): "gpuN MHz/W/C".
# The cards run under their power cap: a card that draws more for communication lowers
# its clock, and this shows it.
smi_start() {
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,utilization.gpu,temperature.gpu \
    --format=csv,noheader,nounits -lms 100 >"$1" 2>/dev/null &
  SMI_PID=$!
}
smi_stop() { [ -n "${SMI_PID:-}" ] && kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; SMI_PID=; }
smi_summary() {
  local g c
  for g in $(awk -F', *' '{print $1}' "$1" | sort -un); do
    printf ' gpu%s' "$g"
    for c in 2 3 5; do
      awk -F', *' -v g="$g" -v c="$c" '$1 == g && $4 >= 95 {print $c}' "$1" | median |
        awk -v c="$c" '{v = sprintf("%.0f", $1)} END {printf "%s%s", c == 2 ? " " : "/", NR ? v : "-"}'
    done
  done
  echo
}
