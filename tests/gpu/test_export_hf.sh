#!/usr/bin/env bash
# meshtrain export against the real thing: models trained on the GPU (untied and tied) are
# exported and loaded with transformers' AutoModelForCausalLM.from_pretrained (and the
# tokenizer with AutoTokenizer), which must give the class the export names; HF's fp32
# logits of a token sequence, on the CPU, must match meshtrain's (tests/dump_logits) within
# max |meshtrain - hf| <= 1e-4 * max |hf| over all positions and the vocabulary, the bound of
# tests/test_export.sh's NumPy twins of HF's forwards; and HF's tokenizer must give
# meshtrain's ids. Mixtures of experts the same way, as MixtralForCausalLM (every layer MoE,
# no shared experts) and Qwen2MoeForCausalLM (shared experts, tied; MoE every second layer):
# trained on the device MOE_DEVICE (cpu unless set: the export and the comparison are the
# point here, not where the model was trained); HF's smallest top-k router margin is
# printed, since a near tie there could route a token otherwise in fp32.
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
MOE_DEVICE=${MOE_DEVICE:-cpu}
"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

M="vocab_size=50257 embed_dim=64 n_heads=4 context_len=64 batch_size=8 data_dir=$D"
TEXT='Once upon a time, there was a little girl named Lily. She loved to play outside in the park.'
IDS="50256 $(printf '%s' "$TEXT" | "$BIN" tokenize)"

# check NAME RUN CLASS: exports RUN/ckpt.bin, loads it as CLASS and compares the logits
check() {
  local name=$1 run=$2 cls=$3 r
  if ! "$BIN" export checkpoint="$run/ckpt.bin" out="$run/hf" >"$run/export.out" 2>&1; then
    bad "${name}_export ($(tail -1 "$run/export.out"))"; return
  fi
  # shellcheck disable=SC2086  # IDS is a list of ids
  "$DUMP" "$run/ckpt.bin" "$run/logits.bin" $IDS || { bad "${name}_dump_logits"; return; }
  # shellcheck disable=SC2086
  if r=$("$PYTHON" - "$run/hf" "$run/logits.bin" "$TEXT" "$cls" $IDS 2>&1 <<'EOF'
import sys, torch, transformers
d, logits_path, text, cls, ids = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], [int(a) for a in sys.argv[5:]]
model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
assert type(model).__name__ == cls, f"loaded as {type(model).__name__}, not {cls}"
tied = model.config.tie_word_embeddings
assert tied == (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()), "tying"
moe = cls != "LlamaForCausalLM"
with torch.no_grad():
    out = model(torch.tensor([ids]), output_router_logits=True) if moe else model(torch.tensor([ids]))
hf = out.logits[0].double()
mt = torch.frombuffer(bytearray(open(logits_path, "rb").read()), dtype=torch.float32).double().reshape(hf.shape)
diff, scale = (mt - hf).abs().max().item(), hf.abs().max().item()
tok = transformers.AutoTokenizer.from_pretrained(d)
same_ids = tok(text)["input_ids"] == ids[1:] and tok.eos_token_id == 50256
routing = ""
if moe:  # the k-th minus the (k+1)-th router logit of each token, in each MoE layer
    k = model.config.num_experts_per_tok
    z = torch.cat([r.reshape(-1, r.shape[-1]) for r in out.router_logits]).double().sort(-1, descending=True).values
    margin = (z[:, k - 1] - z[:, k]).min().item()
    routing = f"; {len(out.router_logits)} MoE layers, smallest top-{k} router margin {margin:.3g}"
print(f"{cls}: max |meshtrain - hf| = {diff:.3g}, max |hf| = {scale:.3g}, ratio {diff / scale:.3g} (bound 1e-4); "
      f"tokenizer {'gives' if same_ids else 'does NOT give'} meshtrain's ids{routing}")
sys.exit(0 if diff <= 1e-4 * scale and same_ids else 1)
EOF
  ); then ok "${name}_transformers_logits_match ($(tail -1 <<<"$r"))"
  else bad "${name}_transformers_logits_match ($(tail -3 <<<"$r" | tr '\n' ' '))"; fi
}

for tied in false true; do
  run=$TMP/run_$tied name=$([ $tied = true ] && echo tied || echo untied)
  # lr=3e-2: weights far from their small init, so attention (and RoPE's layout) matters
  if ! "$BIN" train $M n_layers=2 tie_embeddings=$tied steps=10 lr=3e-2 device=cuda out_dir="$run" progress=false \
       >"$run.log" 2>&1; then
    bad "${name}_train ($(tail -1 "$run.log"))"; continue
  fi
  check "$name" "$run" LlamaForCausalLM
done

# mixtures of experts, 4 experts, top 2: NAME|CLASS|KEYS
for c in "mixtral|MixtralForCausalLM|n_layers=2" \
         "qwen2_moe_shared|Qwen2MoeForCausalLM|n_layers=2 moe_shared_experts=1 tie_embeddings=true" \
         "qwen2_moe_every2|Qwen2MoeForCausalLM|n_layers=4 moe_every=2"; do
  IFS='|' read -r name cls keys <<<"$c"
  run=$TMP/run_$name
  # shellcheck disable=SC2086  # M and keys are lists of keys
  if ! "$BIN" train $M $keys moe_experts=4 moe_top_k=2 steps=10 lr=3e-2 device="$MOE_DEVICE" out_dir="$run" \
       progress=false >"$run.log" 2>&1; then
    bad "${name}_train ($(tail -1 "$run.log"))"; continue
  fi
  check "$name" "$run" "$cls"
done
echo "RESULT $pass $fail"
