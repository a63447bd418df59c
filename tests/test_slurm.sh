#!/usr/bin/env bash
# Slurm (scripts/slurm-local.sh: a one-node cluster with its own munged, slurmctld and
# slurmd): 2 ranks started by `srun --mpi=pmix`, and by mpirun inside an `sbatch --wait`
# allocation, train as `mpirun -np 2` does (losses and parameters); meshtrain takes its rank
# and size from the step (the header, an error printed once); 2 tasks srun starts without
# PMIx (`--mpi=none`) are refused in one line before anything is written, rather than
# training twice into one out_dir; down stops every daemon it started and removes its folder.
# Needs root and Debian's Slurm and munge (scripts/install-deps.sh): without them it says so
# in one line and counts as skipped. It tests launching, not memory: the sanitizer build
# skips it.
TEST_NAME=slurm
source "$(dirname "$0")/lib.sh"
L=scripts/slurm-local.sh
[ -z "${MESHTRAIN_SANITIZED:-}" ] || skip_all "test_slurm: the plain build runs it (it tests launching, not memory)"
why=$($L check 2>&1) || skip_all "test_slurm: $why"
command -v mpirun >/dev/null || skip_all "test_slurm: no mpirun"
use_mpirun
export PATH=$PATH:/usr/sbin

S=$TMP/slurm
trap '$L down "$S" >/dev/null 2>&1; rm -rf "$TMP"' EXIT
trap 'exit 130' INT; trap 'exit 143' TERM
munged_before=$(pgrep -x munged | sort)
out=$($L up "$S" 2>&1) || skip_all "test_slurm: the local cluster did not start: $out"
echo "  $out"
ok up
export SLURM_CONF=$S/slurm.conf
pids=$(cat "$S"/{munged,slurmctld,slurmd}.pid)
expect_exit 1 'exists' up_twice_says_so -- $L up "$S"

prepare_data 300000
M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 steps=5 lr=1e-3 grad_clip=1 progress=false threads=1 val_batches=1 tie_embeddings=true batch_size=4 data_dir=$D"
$MPIRUN -np 2 "$BIN" train $M out_dir="$TMP/mpirun" </dev/null >"$TMP/mpirun.log" 2>&1

# -- srun starts the ranks itself; MPI finds the others through Slurm's PMIx server
if timeout 60 srun -n 2 --mpi=pmix "$BIN" train $M out_dir="$TMP/srun" </dev/null >"$TMP/srun.log" 2>&1 &&
   follows "$TMP/mpirun" "$TMP/srun"
then ok srun_pmix_follows_mpirun; else bad "srun_pmix_follows_mpirun ($(tail -2 "$TMP/srun.log" | tr '\n' ' '))"; fi
grep -q '(device cpu, 2 processes: dp=2' "$TMP/srun.log" && ok srun_header_says_2_processes ||
  bad "srun_header_says_2_processes ($(head -1 "$TMP/srun.log"))"
# ranks known before MPI starts: a bad key is printed once, by rank 0, not by each task
err=$(timeout 60 srun -n 2 --mpi=pmix "$BIN" train $M no_such_key=1 out_dir="$TMP/bad" 2>&1 >/dev/null </dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^meshtrain:' <<<"$err")" = 1 ] && grep -q "no_such_key" <<<"$err" &&
  ok srun_error_printed_once || bad "srun_error_printed_once (exit $rc: $(grep '^meshtrain:' <<<"$err" | tr '\n' ' '))"

# -- a batch job: mpirun inside the allocation takes its hosts and slots from Slurm
cat >"$TMP/job.sh" <<EOF
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --output=$TMP/sbatch.log
$MPIRUN "$BIN" train $M out_dir="$TMP/sbatch"
EOF
if timeout 60 sbatch --wait --quiet "$TMP/job.sh" </dev/null >"$TMP/sbatch.submit" 2>&1 && follows "$TMP/mpirun" "$TMP/sbatch"
then ok sbatch_mpirun_follows_mpirun
else bad "sbatch_mpirun_follows_mpirun ($(cat "$TMP/sbatch.submit"; tail -2 "$TMP/sbatch.log" 2>/dev/null | tr '\n' ' '))"; fi
grep -q '(device cpu, 2 processes: dp=2' "$TMP/sbatch.log" && ok sbatch_header_says_2_processes || bad sbatch_header_says_2_processes

# -- tasks srun starts without PMIx cannot be one job: one line, exit 2, nothing written
err=$(timeout 60 srun -n 2 --mpi=none "$BIN" train $M out_dir="$TMP/none" 2>&1 >/dev/null </dev/null); rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^meshtrain:' <<<"$err")" = 1 ] &&
  grep -q '^meshtrain: rank 0: srun started 2 tasks but MPI did not connect them' <<<"$err" && [ ! -e "$TMP/none" ] &&
  ok srun_without_pmix_refused || bad "srun_without_pmix_refused (exit $rc: $(tr '\n' ' ' <<<"$err"))"
# one task without PMIx is a plain single process
timeout 60 srun -n 1 --mpi=none "$BIN" train ${M/steps=5/steps=1} out_dir="$TMP/one" </dev/null >"$TMP/one.log" 2>&1 &&
  grep -q '(device cpu, 1 process' "$TMP/one.log" && ok srun_one_task_without_pmix_runs ||
  bad "srun_one_task_without_pmix_runs ($(tail -1 "$TMP/one.log"))"

# -- down stops what up started (and nothing else) and removes its folder; twice is fine
$L down "$S" && ok down || bad down
alive=0; for p in $pids; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
[ $alive -eq 0 ] && [ ! -e "$S" ] && [ "$(pgrep -x munged | sort)" = "$munged_before" ] &&
  ok down_stops_its_daemons || bad "down_stops_its_daemons ($alive alive)"
$L down "$S" && ok down_twice || bad down_twice
echo "RESULT $pass $fail"
