#!/usr/bin/env bash
# meshtrain export: a checkpoint becomes a Hugging Face Llama folder that gives the same
# logits. Tiny models (untied, tied, and one saved by two FSDP ranks) are trained, exported,
# and meshtrain's own logits of a token sequence (tests/dump_logits, the cpu forward) are
# compared with tests/hf_llama_numpy.py, an independent NumPy version of HF's
# LlamaForCausalLM that reads only the exported config.json and model.safetensors: within
# max |meshtrain - hf| <= 1e-4 * max |hf| over all positions and the whole vocabulary.
# Also: the files are there and valid JSON, the tokenizer's are GPT-2's, a tied export has
# no lm_head, bad input is one line and exit 2, and nothing half-written is left behind.
TEST_NAME=export
source "$(dirname "$0")/lib.sh"
DUMP=$(dirname "$BIN")/tests/dump_logits
PY=/usr/bin/python3  # Debian's, with python3-numpy (scripts/install-deps.sh); not a pyenv one

if ! "$PY" -c 'import numpy' 2>/dev/null; then
  echo "FAIL $PY has no numpy (run 'make deps': python3-numpy)"; echo "RESULT 0 1"; exit 1
fi

M="vocab_size=50257 embed_dim=32 n_heads=2 n_layers=2 context_len=32 batch_size=4"
D=$TMP/data
head -c 300000 data/tinystories/TinyStories-train.head-2MiB.txt > "$TMP/stories.txt"
"$BIN" prepare input="$TMP/stories.txt" data_dir="$D" val_fraction=0.1 >/dev/null ||
  { echo "FAIL prepare"; echo "RESULT $pass $((fail + 1))"; exit 1; }
# The sequence whose logits are compared: a story's start, after <|endoftext|> as in training.
IDS="50256 $(printf 'Once upon a time, there was a little girl named Lily. She loved to play' | "$BIN" tokenize)"

# check_export NAME RUN TIED: exports RUN/ckpt.bin to RUN/hf and checks the folder and its logits
check_export() {
  local name=$1 run=$2 out=$2/hf tied=$3
  if ! "$BIN" export checkpoint="$run/ckpt.bin" out="$out" > "$run/export.out" 2>&1; then
    bad "${name}_export (exit $?: $(tail -1 "$run/export.out"))"; return
  fi
  local missing=""
  for f in config.json model.safetensors vocab.json merges.txt tokenizer_config.json special_tokens_map.json \
           generation_config.json; do
    [ -s "$out/$f" ] && grep -q "$f" "$run/export.out" || missing="$missing $f"
  done
  [ -z "$missing" ] && ok "${name}_files_written_and_printed" || bad "${name}_files_written_and_printed (missing:$missing)"
  cmp -s "$out/vocab.json" data/gpt2/encoder.json && cmp -s "$out/merges.txt" data/gpt2/vocab.bpe &&
    ok "${name}_tokenizer_is_gpt2" || bad "${name}_tokenizer_is_gpt2"
  ls "$out" | grep -q '\.tmp\.' && bad "${name}_no_temp_files" || ok "${name}_no_temp_files"
  # every JSON file parses; config.json says what the model is; the safetensors header is JSON
  if r=$("$PY" - "$out" "$tied" <<'EOF' 2>&1
import json, struct, sys
d, tied = sys.argv[1], sys.argv[2] == "true"
for f in ("config.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "vocab.json"):
    json.load(open(f"{d}/{f}"))
c = json.load(open(f"{d}/config.json"))
want = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=48,
            num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2, head_dim=16, vocab_size=50257,
            max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
            attention_bias=False, mlp_bias=False, tie_word_embeddings=tied, bos_token_id=50256,
            eos_token_id=50256, torch_dtype="float32")
wrong = {k: c.get(k) for k, v in want.items() if c.get(k) != v}
assert not wrong, f"config.json: {wrong}"
t = json.load(open(f"{d}/tokenizer_config.json"))
assert t["tokenizer_class"] == "GPT2Tokenizer" and t["model_max_length"] == 32 and t["eos_token"] == "<|endoftext|>", t
raw = open(f"{d}/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
assert ("lm_head.weight" in h) != tied, "lm_head.weight present" if tied else "lm_head.weight missing"
assert n % 8 == 0 and h["__metadata__"] == {"format": "pt"}, "header padding or metadata"
EOF
  ); then ok "${name}_json_and_config"; else bad "${name}_json_and_config ($(tail -1 <<<"$r"))"; fi
  # shellcheck disable=SC2086  # IDS is a list of ids
  if "$DUMP" "$run/ckpt.bin" "$run/logits.bin" $IDS && r=$("$PY" tests/hf_llama_numpy.py "$out" "$run/logits.bin" $IDS)
  then ok "${name}_logits_match_hf ($r)"; else bad "${name}_logits_match_hf ($r)"; fi
}

# lr=3e-2 for 10 steps moves the weights well away from their small init, so that attention
# is far from uniform and a wrong RoPE layout shows in the logits
for tied in false true; do
  run=$TMP/run_$tied
  if "$BIN" train $M tie_embeddings=$tied steps=10 lr=3e-2 data_dir="$D" out_dir="$run" progress=false threads=2 \
       > "$run.log" 2>&1; then
    check_export "$([ $tied = true ] && echo tied || echo untied)" "$run" $tied
  else bad "train_$tied (exit $?: $(tail -1 "$run.log"))"; fi
done
# A checkpoint written by two FSDP ranks (two shard files) exports from one process.
if command -v mpirun >/dev/null; then
  run=$TMP/run_fsdp
  if OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
     OMPI_MCA_btl_vader_single_copy_mechanism=none ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" \
     mpirun --oversubscribe --bind-to none --stdin none -np 2 "$BIN" train $M fsdp=true steps=6 lr=3e-2 \
       data_dir="$D" out_dir="$run" progress=false threads=1 > "$run.log" 2>&1 && ls "$run"/ckpt.bin.s*.r1-of-2 >/dev/null 2>&1
  then check_export fsdp2 "$run" false
  else bad "train_fsdp2 (exit $?: $(tail -1 "$run.log"))"; fi
fi

# -- bad input: one line, exit 2, and no folder made for an export that could not start
R=$TMP/run_false
expect_exit 2 "cannot open checkpoint" missing_checkpoint -- "$BIN" export checkpoint="$TMP/none.bin" out="$TMP/o1"
[ ! -e "$TMP/o1" ] && ok missing_checkpoint_makes_no_folder || bad missing_checkpoint_makes_no_folder
head -c 200 "$R/ckpt.bin" > "$TMP/trunc.bin"
expect_exit 2 "truncated" truncated_checkpoint -- "$BIN" export checkpoint="$TMP/trunc.bin" out="$TMP/o2"
C=$TMP/corrupt; mkdir -p "$C"; cp "$R"/ckpt.bin "$R"/ckpt.bin.s*.r0-of-1 "$C"/
SH=$(ls "$C"/ckpt.bin.s*.r0-of-1)
b=$(od -An -tu1 -j4000 -N1 "$SH" | tr -d ' ')
printf "\\$(printf %o $((b ^ 0x55)))" | dd of="$SH" bs=1 seek=4000 conv=notrunc 2>/dev/null
expect_exit 2 "is corrupt \(checksum" corrupt_checkpoint -- "$BIN" export checkpoint="$C/ckpt.bin" out="$TMP/o3"
expect_exit 2 "not a meshtrain checkpoint" foreign_checkpoint -- "$BIN" export checkpoint="$D/train.bin" out="$TMP/o4"
expect_exit 2 "out=/proc/meshtrain-export: cannot create it" out_under_proc -- \
  "$BIN" export checkpoint="$R/ckpt.bin" out=/proc/meshtrain-export
expect_exit 2 "cannot create /proc/" out_unwritable -- "$BIN" export checkpoint="$R/ckpt.bin" out=/proc
expect_exit 2 "is not a folder" out_is_a_file -- "$BIN" export checkpoint="$R/ckpt.bin" out="$TMP/stories.txt"
expect_exit 2 "encoder.json" missing_tokenizer -- "$BIN" export checkpoint="$R/ckpt.bin" out="$TMP/o5" tokenizer_dir="$TMP/nowhere"
expect_exit 2 "does not apply" export_rejects_train_keys -- "$BIN" export checkpoint="$R/ckpt.bin" lr=1
"$BIN" help | grep -q "^  export " && ok help_mentions_export || bad help_mentions_export
echo "RESULT $pass $fail"
