#!/usr/bin/env bash
# meshtrain export against the real thing: models trained on the GPU (untied and tied) are
# exported and loaded with transformers' LlamaForCausalLM.from_pretrained (and the tokenizer
# with AutoTokenizer); HF's fp32 logits of a token sequence, on the CPU, must match
# meshtrain's (tests/dump_logits) within max |meshtrain - hf| <= 1e-4 * max |hf| over all
# positions and the vocabulary, the bound of tests/test_export.sh's NumPy twin of HF's
# forward; and HF's tokenizer must give meshtrain's ids.
#
# Needs a python3 (or $PYTHON) where `import torch, transformers` works; elsewhere it says
# so and reports RESULT 0 0 (a skip, not a failure). Run from the repository root, with
# build/tests/dump_logits beside $MESHTRAIN_BIN.
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
  echo "skipped: '$PYTHON -c \"import torch, transformers\"' fails here (PYTHON=... names another python)"
  echo "RESULT 0 0"; exit 0
fi
source "$(dirname "$0")/lib.sh"
DUMP=$(dirname "$BIN")/tests/dump_logits
"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

M="vocab_size=50257 embed_dim=64 n_heads=4 n_layers=2 context_len=64 batch_size=8 data_dir=$D"
TEXT='Once upon a time, there was a little girl named Lily. She loved to play outside in the park.'
IDS="50256 $(printf '%s' "$TEXT" | "$BIN" tokenize)"

for tied in false true; do
  run=$TMP/run_$tied name=$([ $tied = true ] && echo tied || echo untied)
  # lr=3e-2: weights far from their small init, so attention (and RoPE's layout) matters
  if ! "$BIN" train $M tie_embeddings=$tied steps=10 lr=3e-2 device=cuda out_dir="$run" progress=false >"$run.log" 2>&1; then
    bad "${name}_train ($(tail -1 "$run.log"))"; continue
  fi
  if ! "$BIN" export checkpoint="$run/ckpt.bin" out="$run/hf" >"$run/export.out" 2>&1; then
    bad "${name}_export ($(tail -1 "$run/export.out"))"; continue
  fi
  # shellcheck disable=SC2086  # IDS is a list of ids
  "$DUMP" "$run/ckpt.bin" "$run/logits.bin" $IDS || { bad "${name}_dump_logits"; continue; }
  # shellcheck disable=SC2086
  if r=$("$PYTHON" - "$run/hf" "$run/logits.bin" "$TEXT" $IDS 2>&1 <<'EOF'
import sys, torch, transformers
d, logits_path, text, ids = sys.argv[1], sys.argv[2], sys.argv[3], [int(a) for a in sys.argv[4:]]
model = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
tied = model.config.tie_word_embeddings
assert tied == (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()), "tying"
with torch.no_grad():
    hf = model(torch.tensor([ids])).logits[0].double()
mt = torch.frombuffer(bytearray(open(logits_path, "rb").read()), dtype=torch.float32).double().reshape(hf.shape)
diff, scale = (mt - hf).abs().max().item(), hf.abs().max().item()
tok = transformers.AutoTokenizer.from_pretrained(d)
same_ids = tok(text)["input_ids"] == ids[1:] and tok.eos_token_id == 50256
print(f"max |meshtrain - hf| = {diff:.3g}, max |hf| = {scale:.3g}, ratio {diff / scale:.3g} (bound 1e-4); "
      f"tokenizer {'gives' if same_ids else 'does NOT give'} meshtrain's ids")
sys.exit(0 if diff <= 1e-4 * scale and same_ids else 1)
EOF
  ); then ok "${name}_transformers_logits_match ($(tail -1 <<<"$r"))"
  else bad "${name}_transformers_logits_match ($(tail -3 <<<"$r" | tr '\n' ' '))"; fi
done
echo "RESULT $pass $fail"
