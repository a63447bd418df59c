#!/usr/bin/env bash
# meshtrain plot: hand-written logs with known values -> an SVG whose drawing is read back
# (tests/svg_summary.py: well-formed XML, panels, tick labels, and the plotted values
# recovered from the coordinates); bad input is one line and exit 2; and one real tiny run,
# stopped and resumed, plotted end to end.
TEST_NAME=plot
source "$(dirname "$0")/lib.sh"
PY=/usr/bin/python3
SUMMARY=tests/svg_summary.py
# has SUMMARY_FILE LINE NAME: the summary holds exactly this line
has() { if grep -qxF -- "$2" "$1"; then ok "$3"; else bad "$3 (want '$2'; got '$(grep -F "${2%%=*}=" "$1" | head -1 | cut -c1-200)')"; fi; }
summarize() { "$PY" "$SUMMARY" "$1" > "$2" 2> "$2.err" || { cat "$2.err"; return 1; }; }

# -- a run that died after its step-4 checkpoint (steps 5 and 6 and the validation at 6
# logged), resumed from step 4 with other losses; a null, an inf, unknown and nested keys,
# an error line, and a last line cut short by a kill.
L=$TMP/resumed
mkdir -p "$L"
cat > "$L/log.jsonl" <<'EOF'
{"step":1,"loss":6.0,"lr":2.5e-4,"grad_norm":1.5,"ms":10,"tokens_per_s":750,"gflops":1.0}
{"step":2,"loss":5.0,"lr":5e-4,"grad_norm":1.5,"ms":10,"tokens_per_s":1000,"gflops":1.0}
{"step":3,"loss":4.0,"lr":7.5e-4,"grad_norm":null,"ms":10,"tokens_per_s":1250,"extra":{"a":[1,2,{"b":null}]}}
{"step":3,"val_loss":4.5}
{"step":4,"loss":3.0,"lr":1e-3,"grad_norm":inf,"ms":10,"tokens_per_s":1500,"note":"a \"quoted\" \u00e9 string"}
{"step":5,"loss":2.0,"lr":1.25e-3,"grad_norm":1.5,"ms":10,"tokens_per_s":1500}
{"step":6,"loss":1.0,"lr":1.5e-3,"grad_norm":1.5,"ms":10,"tokens_per_s":1500}
{"step":6,"val_loss":1.5}
{"step":5,"loss":10.0,"lr":1.25e-3,"grad_norm":1.5,"ms":10,"tokens_per_s":1500}
{"step":6,"loss":9.0,"lr":1.5e-3,"grad_norm":1.5,"ms":10,"tokens_per_s":1500}
{"step":7,"loss":8.0,"lr":1.5e-3,"grad_norm":1.5,"ms":10,"tokens_per_s":1500}
{"step":8,"loss":7.0,"lr":1.5e-3,"grad_norm":1.5,"ms":10,"tokens_per_s":1500}
{"step":8,"val_loss":7.5}
{"done":true,"steps":4,"world":1,"tokens_per_s":250000.0,"loss":7.0,"val_loss":7.5}
{"step":9,"error":"non-finite loss"}
{"step":9,"loss":6.5,"lr":3e-
EOF
printf '%s' "$(cat "$L/log.jsonl")" > "$L/log.jsonl"  # no newline after the cut-short line
out=$("$BIN" plot log="$L/log.jsonl" 2>&1); rc=$?
S=$TMP/resumed.txt
if [ $rc -eq 0 ] && [ -s "$L/log.svg" ] && grep -qF -- "-> $L/log.svg" <<<"$out"; then ok "plot_default_out ($out)"
else bad "plot_default_out (exit $rc: $out)"; fi
grep -q "1 unreadable line skipped, the first line 16" <<<"$out" && ok reports_cut_short_line || bad "reports_cut_short_line ($out)"
if summarize "$L/log.svg" "$S"; then ok svg_well_formed; else bad svg_well_formed; fi
has "$S" "panels=loss lr tokens" three_panels
has "$S" "title=$L/log.jsonl" title_is_log_path
# 8 distinct steps from 10 step lines; the resumed run's losses for steps 5 and 6
has "$S" "points.loss-line=8" loss_points_once_per_step
has "$S" "values.loss-line=1:6 2:5 3:4 4:3 5:10 6:9 7:8 8:7" loss_later_value_wins
# the validation at step 6 came from the run that died: the resumed one replaced it
has "$S" "markers=2" val_markers
has "$S" "values.val-line=3:4.5 8:7.5" val_values
has "$S" "legend=training loss|validation loss" legend
has "$S" "ticks.loss=3 4 5 6 7 8 9 10" loss_ticks
has "$S" "ticks.lr=0 5e-4 1e-3 1.5e-3" lr_ticks_compact
has "$S" "ticks.tokens=0 500 1k 1.5k" tokens_ticks_compact
has "$S" "xticks=1 2 3 4 5 6 7 8" step_ticks
has "$S" "points.tokens-line=8" tokens_points
grep -q "^subtitle=8 steps .*last loss 7.0000 .*validation loss 7.5000 (step 8) .*resumed 1 time" "$S" \
  && ok subtitle || bad "subtitle ($(grep subtitle "$S"))"
ls "$L" | grep -q tmp && bad "no_temp_file_left ($(ls "$L"))" || ok no_temp_file_left

# -- one step: a dot on real (non-degenerate) axes; a title with XML's special characters
printf '{"step":1,"loss":2.5,"lr":3e-4,"grad_norm":1,"ms":5,"tokens_per_s":250000}\n' > "$TMP/one.jsonl"
S=$TMP/one.txt
if "$BIN" plot log="$TMP/one.jsonl" out="$TMP/one.svg" title='a <b> & "c" run' >/dev/null && summarize "$TMP/one.svg" "$S"
then ok one_step_plots; else bad one_step_plots; fi
has "$S" 'title=a <b> & "c" run' title_key_escaped
long=$(printf 'a/long/path/%.0s' {1..15})log.jsonl
"$BIN" plot log="$TMP/one.jsonl" out="$TMP/long.svg" title="$long" >/dev/null && summarize "$TMP/long.svg" "$TMP/long.txt"
t=$(grep '^title=' "$TMP/long.txt"); t=${t#title=}
[[ $t == "…"*"/a/long/path/log.jsonl" && ${#t} -lt ${#long} ]] && ok long_title_cut_from_the_left || bad "long_title_cut_from_the_left ($t)"
has "$S" "points.loss-line=1" one_step_one_point
has "$S" "values.loss-line=1:2.5" one_step_value
has "$S" "legend=training loss" legend_without_validation
has "$S" "markers=0" no_markers
has "$S" "ticks.tokens=0 50k 100k 150k 200k 250k" large_ticks_compact
n_ticks() { grep "^$1=" "$S" | cut -d= -f2 | wc -w; }
if [ "$(n_ticks ticks.loss)" -ge 3 ] && [ "$(n_ticks ticks.lr)" -ge 2 ] && [ "$(n_ticks ticks.tokens)" -ge 2 ] &&
   [ "$(n_ticks xticks)" -ge 2 ]; then ok one_step_axes; else bad "one_step_axes ($(grep ticks "$S" | tr '\n' ' '))"; fi

# -- constant values: a flat line inside a real axis
for s in 1 2 3 4 5; do printf '{"step":%d,"loss":2.5,"lr":3e-4,"tokens_per_s":5000}\n' $s; done > "$TMP/flat.jsonl"
S=$TMP/flat.txt
if "$BIN" plot log="$TMP/flat.jsonl" out="$TMP/flat.svg" >/dev/null && summarize "$TMP/flat.svg" "$S"; then ok flat_plots
else bad flat_plots; fi
has "$S" "values.loss-line=1:2.5 2:2.5 3:2.5 4:2.5 5:2.5" flat_loss
[ "$(n_ticks ticks.loss)" -ge 3 ] && ok flat_loss_axis || bad "flat_loss_axis ($(grep ticks.loss "$S"))"

# -- the parser is strict enough: a malformed number makes the line unreadable, not 3.2
printf '{"step":1,"loss":4}\n{"step":2,"loss":3.2.1}\n{"step":3,"loss":2}\n{"step":4,"loss":"1"}\n' > "$TMP/strict.jsonl"
S=$TMP/strict.txt
out=$("$BIN" plot log="$TMP/strict.jsonl" out="$TMP/strict.svg") && summarize "$TMP/strict.svg" "$S"
has "$S" "values.loss-line=1:4 3:2" malformed_lines_skipped
grep -q "2 unreadable lines skipped, the first line 2" <<<"$out" && ok reports_unreadable || bad "reports_unreadable ($out)"

# -- bad input: one line, exit 2, no SVG
expect_exit 2 "cannot open $TMP/none.jsonl" missing_log -- "$BIN" plot log="$TMP/none.jsonl"
expect_exit 2 "cannot read $TMP" log_is_a_folder -- "$BIN" plot log="$TMP" out="$TMP/x.svg"
printf '{"done":true,"steps":3}\n{"step":2,"val_loss":3}\nnot json\n' > "$TMP/nosteps.jsonl"
expect_exit 2 "no step lines" no_step_lines -- "$BIN" plot log="$TMP/nosteps.jsonl"
: > "$TMP/empty.jsonl"
expect_exit 2 "no step lines" empty_log -- "$BIN" plot log="$TMP/empty.jsonl"
expect_exit 2 "out=$TMP/no/such/dir/p.svg: cannot create" unwritable_out -- "$BIN" plot log="$TMP/one.jsonl" out="$TMP/no/such/dir/p.svg"
expect_exit 2 "is the log itself" out_is_log -- "$BIN" plot log="$TMP/one.jsonl" out="$TMP/one.jsonl"
grep -q '"step":1' "$TMP/one.jsonl" && ok log_kept || bad log_kept
expect_exit 2 "does not apply" train_key_refused -- "$BIN" plot steps=3
expect_exit 2 "unknown key" unknown_key -- "$BIN" plot colour=red
[ ! -e "$TMP/nosteps.svg" ] && [ ! -e "$TMP/empty.svg" ] && ok no_svg_on_bad_input || bad no_svg_on_bad_input
"$BIN" help plot | grep -q "out=.*<log's folder>/log.svg" && ok help_says_default_out || bad help_says_default_out
# the README's tables name the command and each of its keys (test_cli.sh checks every key)
grep -q '^| `plot` |' README.md && grep -q '^| `log` |' README.md && grep -q '^| `out` |' README.md &&
  grep -q '^| `title` |' README.md && ok readme_documents_plot || bad readme_documents_plot

# -- a real run: a tiny model stopped by a NaN at step 5 after its step-3 checkpoint, then
# resumed to step 6; the picture holds steps 1..6 once each, the resumed run's values.
TINY="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=1 context_len=32 batch_size=4"
D=$TMP/data R=$TMP/run
head -c 100000 data/tinystories/TinyStories-train.head-2MiB.txt > "$TMP/stories.txt"
"$BIN" prepare input="$TMP/stories.txt" data_dir="$D" val_fraction=0.1 >/dev/null || bad prepare
MESHTRAIN_FAULT_NAN_STEP=5 "$BIN" train $TINY data_dir="$D" steps=6 ckpt_every=3 val_every=2 val_batches=2 lr=3e-3 \
  out_dir="$R" progress=false threads=2 >/dev/null 2>&1
rc1=$?
"$BIN" train resume="$R/ckpt.bin" data_dir="$D" steps=6 val_every=2 val_batches=2 out_dir="$R" progress=false threads=2 \
  >/dev/null 2>&1
rc2=$?
n4=$(grep -c '^{"step":4,"loss"' "$R/log.jsonl")
if [ $rc1 -eq 1 ] && [ $rc2 -eq 0 ] && [ "$n4" -eq 2 ]; then ok "real_run_resumed (step 4 logged twice)"
else bad "real_run_resumed (exit $rc1, $rc2; step 4 logged $n4 times)"; fi
S=$TMP/real.txt
out=$("$BIN" plot log="$R/log.jsonl" title="tiny run" 2>&1) && summarize "$R/log.svg" "$S"
grep -qF "(6 steps, 3 validations, resumed 1 time)" <<<"$out" && ok "real_plot ($out)" || bad "real_plot ($out)"
has "$S" "points.loss-line=6" real_loss_points
has "$S" "markers=3" real_val_markers
# every plotted loss is the log's last value for its step (read back to 0.01)
want=$(grep -o '^{"step":[0-9]*,"loss":[0-9.]*' "$R/log.jsonl" | awk -F'[:,]' '{v[$2] = $4} END {for (s = 1; s <= 6; s++) printf "%d:%s ", s, v[s]}')
got=$(grep '^values.loss-line=' "$S" | cut -d= -f2)
if awk -v w="$want" -v g="$got" 'BEGIN { n = split(w, a, " "); if (split(g, b, " ") != n || n != 6) exit 1
     for (i = 1; i <= n; i++) { split(a[i], x, ":"); split(b[i], y, ":"); d = x[2] - y[2]
       if (x[1] != y[1] || d > 0.01 || d < -0.01) exit 1 } }'; then ok real_values_are_the_resumed_runs
else bad "real_values_are_the_resumed_runs (log: $want; svg: $got)"; fi
echo "RESULT $pass $fail"
