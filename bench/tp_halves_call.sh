#!/usr/bin/env bash
# For a four-GPU call (written in session 25, not yet run): MESHTRAIN_TP_HALVES=1 on GPUs - its correctness cases of
# bench/tp_ce_check.sh against one GPU, then the TP-efficiency step with and without it.
# Usage: bench/tp_halves_call.sh BUILD OUTDIR
set -u
B=$1 O=$2
NP=4 ONLY="^(fused2_sp|fused3_sp|halves)" MESHTRAIN_BIN=$B/meshtrain timeout 200 bash bench/tp_ce_check.sh > $O/check.log 2>&1
grep -E "^ok|^FAIL|^bad|RESULT" $O/check.log
NP=4 REPS=1 STEPS=15 VARIANTS=";MESHTRAIN_TP_HALVES=1;MESHTRAIN_TP_HALVES=1 MESHTRAIN_TP_FUSED=3" timeout 300 bash bench/tp_eff_rows.sh $B/meshtrain 2>&1 | tail -6
