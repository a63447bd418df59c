#!/usr/bin/env bash
# meshtrain export: a checkpoint becomes a Hugging Face folder that gives the same logits.
# Tiny models (untied, tied, and one saved by two FSDP ranks) are trained, exported as
# LlamaForCausalLM, and meshtrain's own logits of a token sequence (tests/dump_logits, the
# cpu forward) are compared with tests/hf_llama_numpy.py, an independent NumPy version of
# HF's LlamaForCausalLM that reads only the exported config.json and model.safetensors:
# within max |meshtrain - hf| <= 1e-4 * max |hf| over all positions and the whole vocabulary.
# Mixtures of experts the same way against tests/hf_moe_numpy.py (HF's MixtralForCausalLM
# and Qwen2MoeForCausalLM): every layer MoE without shared experts (Mixtral), with shared
# experts (Qwen2-MoE, tied), MoE every second layer with a capacity factor (Qwen2-MoE, dense
# layers between; the export says it is dropless); a sigmoid router is refused.
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

# check_export NAME RUN TIED [MOE]: exports RUN/ckpt.bin to RUN/hf and checks the folder and
# its logits. MOE: a MoE export's config.json keys beyond the ones every class has, as JSON
# (architectures and model_type among them); none: a Llama export.
check_export() {
  local name=$1 run=$2 out=$2/hf tied=$3 moe=${4:-} twin=tests/hf_llama_numpy.py
  [ -n "$moe" ] && twin=tests/hf_moe_numpy.py
  if ! "$BIN" export checkpoint="$run/ckpt.bin" out="$out" > "$run/export.out" 2>&1; then
    bad "${name}_export (exit $?: $(tail -1 "$run/export.out"))"; return
  fi
  local missing=""
  # shellcheck disable=SC2046  # a MoE export also has tokenizer.json
  for f in config.json model.safetensors vocab.json merges.txt tokenizer_config.json special_tokens_map.json \
           generation_config.json $([ -n "$moe" ] && echo tokenizer.json); do
    [ -s "$out/$f" ] && grep -q "$f" "$run/export.out" || missing="$missing $f"
  done
  [ -z "$missing" ] && ok "${name}_files_written_and_printed" || bad "${name}_files_written_and_printed (missing:$missing)"
  cmp -s "$out/vocab.json" data/gpt2/encoder.json && cmp -s "$out/merges.txt" data/gpt2/vocab.bpe &&
    ok "${name}_tokenizer_is_gpt2" || bad "${name}_tokenizer_is_gpt2"
  ls "$out" | grep -q '\.tmp\.' && bad "${name}_no_temp_files" || ok "${name}_no_temp_files"
  # every JSON file parses; config.json says what the model is; the safetensors header is JSON
  if r=$("$PY" - "$out" "$tied" "$moe" <<'EOF' 2>&1
import json, struct, sys
d, tied, moe = sys.argv[1], sys.argv[2] == "true", sys.argv[3]
for f in ("config.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "vocab.json"):
    json.load(open(f"{d}/{f}"))
c = json.load(open(f"{d}/config.json"))
want = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=50257,
            max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
            tie_word_embeddings=tied, bos_token_id=50256, eos_token_id=50256, torch_dtype="float32")
want.update(json.loads(moe) if moe else
            dict(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=48, num_hidden_layers=2,
                 head_dim=16, attention_bias=False, mlp_bias=False))
wrong = {k: c.get(k) for k, v in want.items() if c.get(k) != v}
assert not wrong, f"config.json: {wrong}"
t = json.load(open(f"{d}/tokenizer_config.json"))
assert t["tokenizer_class"] == "GPT2Tokenizer" and t["model_max_length"] == 32 and t["eos_token"] == "<|endoftext|>", t
raw = open(f"{d}/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
assert ("lm_head.weight" in h) != tied, "lm_head.weight present" if tied else "lm_head.weight missing"
assert n % 8 == 0 and h["__metadata__"] == {"format": "pt"}, "header padding or metadata"
if moe:  # tokenizer.json is GPT-2's: byte-level BPE of encoder.json and vocab.bpe's merges
    t = json.load(open(f"{d}/tokenizer.json"))
    merges = [m for m in open("data/gpt2/vocab.bpe", encoding="utf-8").read().split("\n")[1:] if m]
    assert t["model"]["type"] == "BPE" and t["model"]["vocab"] == json.load(open("data/gpt2/encoder.json")) and \
        t["model"]["merges"] == merges and t["pre_tokenizer"]["type"] == "ByteLevel" and \
        t["added_tokens"][0]["id"] == 50256, "tokenizer.json is not GPT-2's"
EOF
  ); then ok "${name}_json_and_config"; else bad "${name}_json_and_config ($(tail -1 <<<"$r"))"; fi
  # shellcheck disable=SC2086  # IDS is a list of ids
  if "$DUMP" "$run/ckpt.bin" "$run/logits.bin" $IDS && r=$("$PY" "$twin" "$out" "$run/logits.bin" $IDS)
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

# -- mixtures of experts (4 experts, top 2; expert width 1.5 x 32 / 2 = 24 unless given):
# NAME TIED KEYS MOE (check_export's). lr=3e-2 for 10 steps also spreads the router's
# logits, so that no token's k-th and (k+1)-th expert are close enough for fp32 rounding to
# choose between them (hf_moe_numpy.py prints the smallest margin, and would match a near
# tie taken either way).
MOE_COMMON='"num_experts_per_tok": 2, "router_aux_loss_coef": 0.01, "output_router_logits": false,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}'
QWEN='"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "intermediate_size": 48,
  "num_experts": 4, "norm_topk_prob": true, "qkv_bias": true, "use_sliding_window": false, "mlp_only_layers": []'
moe_cases=(
  "mixtral|false|n_layers=2|{$MOE_COMMON, \"architectures\": [\"MixtralForCausalLM\"],
    \"model_type\": \"mixtral\", \"num_hidden_layers\": 2, \"head_dim\": 16, \"intermediate_size\": 24,
    \"num_local_experts\": 4, \"sliding_window\": null}"
  "qwen2_moe_shared|true|n_layers=2 moe_shared_experts=2 moe_expert_dim=16|{$MOE_COMMON, $QWEN,
    \"num_hidden_layers\": 2, \"decoder_sparse_step\": 1, \"moe_intermediate_size\": 16,
    \"shared_expert_intermediate_size\": 32}"
  # no shared experts: Qwen2-MoE's is a zero one of width 1
  "qwen2_moe_every2|false|n_layers=4 moe_every=2 moe_capacity_factor=2|{$MOE_COMMON, $QWEN,
    \"num_hidden_layers\": 4, \"decoder_sparse_step\": 2, \"moe_intermediate_size\": 24,
    \"shared_expert_intermediate_size\": 1}"
)
for c in "${moe_cases[@]}"; do
  IFS='|' read -r -d '' name tied keys moe <<<"$c"  # (-d '': moe spans lines)
  run=$TMP/run_$name
  # shellcheck disable=SC2086  # M and keys are lists of keys
  if "$BIN" train ${M/n_layers=2/} $keys moe_experts=4 moe_top_k=2 tie_embeddings=$tied steps=10 lr=3e-2 \
       data_dir="$D" out_dir="$run" progress=false threads=2 > "$run.log" 2>&1; then
    check_export "$name" "$run" "$tied" "$moe"
  else bad "train_$name (exit $?: $(tail -1 "$run.log"))"; fi
done
# moe_capacity_factor > 0 drops routed choices in training (2, at 4 experts and top 2, drops
# none, so the logits above still match); the export says that it, like transformers, is
# dropless, and says nothing of it without a capacity factor
grep -q "moe_capacity_factor=2 .*dropless" "$TMP/run_qwen2_moe_every2/export.out" &&
  ! grep -q dropless "$TMP/run_mixtral/export.out" && ok moe_export_says_dropless || bad moe_export_says_dropless
run=$TMP/run_sigmoid
if "$BIN" train $M moe_experts=4 moe_top_k=2 moe_router=sigmoid steps=2 data_dir="$D" out_dir="$run" progress=false \
     threads=2 > "$run.log" 2>&1; then
  expect_exit 2 "moe_router=sigmoid has no Hugging Face model class" sigmoid_router_refused -- \
    "$BIN" export checkpoint="$run/ckpt.bin" out="$run/hf"
  [ ! -e "$run/hf" ] && ok sigmoid_router_makes_no_folder || bad sigmoid_router_makes_no_folder
else bad "train_sigmoid (exit $?: $(tail -1 "$run.log"))"; fi
run=$TMP/run_bias
if "$BIN" train $M moe_experts=4 moe_top_k=2 moe_bias_balance=0.001 steps=2 data_dir="$D" out_dir="$run" progress=false \
     threads=2 > "$run.log" 2>&1; then
  expect_exit 2 "routes with expert selection biases" selection_biases_refused -- \
    "$BIN" export checkpoint="$run/ckpt.bin" out="$run/hf"
else bad "train_bias (exit $?: $(tail -1 "$run.log"))"; fi

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
