"""The Hugging Face mixture-of-experts forwards that `meshtrain export` writes, in NumPy:
MixtralForCausalLM and Qwen2MoeForCausalLM, from HF's published model definitions
(transformers' modeling_mixtral.py: MixtralSparseMoeBlock, its router and experts w1, w3,
w2; modeling_qwen2_moe.py: Qwen2MoeSparseMoeBlock with its shared_expert and
shared_expert_gate, Qwen2MoeDecoderLayer's choice of sparse layers by decoder_sparse_step
and mlp_only_layers, q/k/v biases by qkv_bias), written without looking at meshtrain's
code, on tests/hf_llama_numpy.py's decoder (both classes share Llama's attention, norms
and RoPE). It reads only an exported folder's config.json and model.safetensors, with the
classes' own defaults for what config.json leaves out. Computes in float64.

Routing, as both classes do it: a softmax over all experts' router logits, the top k
(num_experts_per_tok), their weights renormalised to sum 1 (Mixtral always; Qwen2-MoE when
norm_topk_prob), each expert a SwiGLU MLP. A token whose k-th and (k+1)-th logits lie
within ROUTE_TOL * (1 + max |logit|) is a near tie, which fp32 rounding may settle either
way, in meshtrain as in transformers. If the logits do not match with the choices made
here, near ties are taken the other way (each switch re-routes the layers after it; at
most MAX_SWITCHES at once, smallest margins first), and a match then is reported with the
switches it needed. A real difference matches under no such choice.

usage: /usr/bin/python3 tests/hf_moe_numpy.py DIR LOGITS.bin ID...
  LOGITS.bin: the fp32 [T, V] logits meshtrain gives for ID... (tests/dump_logits).
  Prints the comparison; exit 0 when max|meshtrain - hf| <= TOL * max|hf| (TOL = 1e-4,
  or $HF_TOL), 1 when not, 2 when the folder is malformed.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama_numpy  # noqa: E402
from hf_llama_numpy import fail, forward, read_safetensors, silu, softmax, swiglu_mlp  # noqa: E402

hf_llama_numpy.PROG = "hf_moe_numpy"

ROUTE_TOL = 1e-4
MAX_SWITCHES = 4
MAX_FORWARDS = 200
# What each class takes when config.json leaves a key out (configuration_*.py).
DEFAULTS = {
    "mixtral": dict(rope_theta=1e6, rms_norm_eps=1e-5, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
    "qwen2_moe": dict(rope_theta=1e4, rms_norm_eps=1e-6, num_key_value_heads=16, num_experts=60,
                      num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                      qkv_bias=True, use_sliding_window=False, tie_word_embeddings=False),
}
CLASS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


class Router:
    """Top-k routing of every MoE layer of one forward; `switched` holds the (layer, token)
    near ties to take the other way."""

    def __init__(self, switched):
        self.switched, self.ties, self.choices, self.min_margin = switched, [], 0, np.inf

    def route(self, layer, logits, k, renormalise):
        T, X = logits.shape
        probs = softmax(logits)
        order = np.argsort(-probs, axis=-1, kind="stable")
        idx = order[:, :k].copy()
        self.choices += T * k
        for t in range(T):
            if k == X:
                continue
            z = logits[t]
            margin = z[order[t, k - 1]] - z[order[t, k]]
            self.min_margin = min(self.min_margin, margin)
            if margin < ROUTE_TOL * (1.0 + np.max(np.abs(z))):
                self.ties.append((margin, (layer, t)))
            if (layer, t) in self.switched:
                idx[t, k - 1] = order[t, k]
        w = np.take_along_axis(probs, idx, axis=-1)
        if renormalise:
            w = w / np.sum(w, axis=-1, keepdims=True)
        return idx, w


def layer_of(prefix):  # "model.layers.3." -> 3
    return int(prefix.split(".")[2])


def experts_sum(h, idx, w, expert):
    """sum over each token's chosen experts of weight * expert(e, its rows)."""
    out = np.zeros_like(h)
    for e in np.unique(idx):
        tok, j = np.nonzero(idx == e)
        out[tok] += w[tok, j, None] * expert(int(e), h[tok])
    return out


def mixtral_mlp(cfg, router):
    k = cfg["num_experts_per_tok"]

    def mlp(W, p, h):  # MixtralSparseMoeBlock
        g = lambda name: W[p + "block_sparse_moe." + name].astype(np.float64)
        idx, w = router.route(layer_of(p), h @ g("gate.weight").T, k, True)
        expert = lambda e, x: (silu(x @ g(f"experts.{e}.w1.weight").T) * (x @ g(f"experts.{e}.w3.weight").T)
                               ) @ g(f"experts.{e}.w2.weight").T  # MixtralBlockSparseTop2MLP
        return experts_sum(h, idx, w, expert)
    return mlp


def qwen2_moe_sparse(cfg, i):  # Qwen2MoeDecoderLayer
    return i not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0


def qwen2_moe_mlp(cfg, router):
    k, norm = cfg["num_experts_per_tok"], cfg["norm_topk_prob"]

    def mlp(W, p, h):
        if not qwen2_moe_sparse(cfg, layer_of(p)):
            return swiglu_mlp(W, p + "mlp.", h)  # Qwen2MoeMLP of intermediate_size
        g = lambda name: W[p + "mlp." + name].astype(np.float64)
        idx, w = router.route(layer_of(p), h @ g("gate.weight").T, k, norm)
        routed = experts_sum(h, idx, w, lambda e, x: swiglu_mlp(W, p + f"mlp.experts.{e}.", x))
        shared_gate = 1.0 / (1.0 + np.exp(-(h @ g("shared_expert_gate.weight").T)))  # [T, 1]
        return routed + shared_gate * swiglu_mlp(W, p + "mlp.shared_expert.", h)
    return mlp


def expected_tensors(cfg, mt):
    """{name: shape} of every tensor the class loads."""
    E, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or E // nh
    want = {"model.embed_tokens.weight": [V, E], "model.norm.weight": [E]}
    if not cfg["tie_word_embeddings"]:
        want["lm_head.weight"] = [V, E]
    swiglu = lambda p, H: {p + "gate_proj.weight": [H, E], p + "up_proj.weight": [H, E], p + "down_proj.weight": [E, H]}
    for i in range(L):
        p = f"model.layers.{i}."
        want.update({p + "input_layernorm.weight": [E], p + "post_attention_layernorm.weight": [E],
                     p + "self_attn.q_proj.weight": [nh * hd, E], p + "self_attn.k_proj.weight": [nkv * hd, E],
                     p + "self_attn.v_proj.weight": [nkv * hd, E], p + "self_attn.o_proj.weight": [E, nh * hd]})
        if mt == "mixtral":
            X, H = cfg["num_local_experts"], cfg["intermediate_size"]
            want[p + "block_sparse_moe.gate.weight"] = [X, E]
            for e in range(X):
                q = p + f"block_sparse_moe.experts.{e}."
                want.update({q + "w1.weight": [H, E], q + "w3.weight": [H, E], q + "w2.weight": [E, H]})
            continue
        if cfg["qkv_bias"]:
            want.update({p + "self_attn.q_proj.bias": [nh * hd], p + "self_attn.k_proj.bias": [nkv * hd],
                         p + "self_attn.v_proj.bias": [nkv * hd]})
        if not qwen2_moe_sparse(cfg, i):
            want.update(swiglu(p + "mlp.", cfg["intermediate_size"]))
            continue
        X = cfg["num_experts"]
        want.update({p + "mlp.gate.weight": [X, E], p + "mlp.shared_expert_gate.weight": [1, E]})
        want.update(swiglu(p + "mlp.shared_expert.", cfg["shared_expert_intermediate_size"]))
        for e in range(X):
            want.update(swiglu(p + f"mlp.experts.{e}.", cfg["moe_intermediate_size"]))
    return want


def read_config(d):
    try:
        with open(os.path.join(d, "config.json")) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"config.json: {e}")
    mt = raw.get("model_type")
    if mt not in CLASS or raw.get("architectures") != [CLASS[mt]]:
        fail(f"config.json is not a {' or '.join(CLASS.values())}'s (model_type {mt!r})")
    cfg = dict(DEFAULTS[mt], **raw)
    # transformers 5 reads rope_parameters first, then the older rope_theta, then the default
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        fail(f"only the default RoPE is modelled here: rope_parameters {rope}, rope_scaling {raw.get('rope_scaling')}")
    if "rope_theta" in rope and "rope_theta" in raw and rope["rope_theta"] != raw["rope_theta"]:
        fail(f"rope_parameters' rope_theta {rope['rope_theta']} and rope_theta {raw['rope_theta']} differ")
    cfg["rope_theta"] = rope.get("rope_theta", cfg["rope_theta"])
    if cfg.get("hidden_act", "silu") != "silu":
        fail(f"hidden_act {cfg['hidden_act']}: only silu is modelled here")
    if mt == "mixtral" and cfg["sliding_window"] is not None:
        fail(f"sliding_window {cfg['sliding_window']}: only full attention is modelled here")
    if mt == "qwen2_moe" and cfg["use_sliding_window"]:
        fail("use_sliding_window: only full attention is modelled here")
    return mt, cfg


def main():
    if len(sys.argv) < 4:
        fail(__doc__.strip().splitlines()[-4])
    d, logits_path, ids = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
    mt, cfg = read_config(d)
    W = read_safetensors(os.path.join(d, "model.safetensors"))
    want = expected_tensors(cfg, mt)
    if set(W) != set(want):
        fail(f"tensors missing: {sorted(set(want) - set(W))}, unexpected: {sorted(set(W) - set(want))}")
    shapes = {n: list(W[n].shape) for n in W if list(W[n].shape) != want[n]}
    if shapes:
        fail(f"shapes {shapes}, expected {({n: want[n] for n in shapes})}")

    def run(switched):
        router = Router(switched)
        mlp = (mixtral_mlp if mt == "mixtral" else qwen2_moe_mlp)(cfg, router)
        return forward(cfg, W, ids, mlp=mlp, qkv_bias=mt == "qwen2_moe" and cfg["qkv_bias"]), router

    hf, router = run(frozenset())
    mt_logits = np.fromfile(logits_path, dtype="<f4").astype(np.float64)
    if mt_logits.size != hf.size:
        fail(f"{logits_path} holds {mt_logits.size} logits; the model gives {hf.size}")
    mt_logits = mt_logits.reshape(hf.shape)
    tol = float(os.environ.get("HF_TOL", "1e-4"))
    ratio = lambda out: np.max(np.abs(mt_logits - out)) / np.max(np.abs(out))
    first, switched = router, frozenset()
    if ratio(hf) > tol:  # near ties taken the other way, depth first, smallest margins first
        seen, budget, stack = {switched}, MAX_FORWARDS, [(switched, router)]
        while stack and budget > 0:
            base, r = stack.pop()
            if len(base) == MAX_SWITCHES:
                continue
            for _, key in sorted(r.ties, reverse=True):  # (popped last: the smallest margin first)
                s = base | {key}
                if s not in seen:
                    seen.add(s)
                    budget -= 1
                    out, r2 = run(s)
                    if ratio(out) <= tol:
                        hf, router, switched, stack = out, r2, s, []
                        break
                    stack.append((s, r2))
    diff, scale = np.max(np.abs(mt_logits - hf)), np.max(np.abs(hf))
    same_argmax = np.mean(np.argmax(mt_logits, -1) == np.argmax(hf, -1))
    rel = diff / scale
    sw = f"; matched with {len(switched)} near ties taken the other way: " + ", ".join(
        f"layer {layer} token {t}" for layer, t in sorted(switched)) if switched else ""
    print(f"{CLASS[mt]}, {len(W)} tensors, logits [{hf.shape[0]}, {hf.shape[1]}]: max |meshtrain - hf| = {diff:.3g}, "
          f"max |hf| = {scale:.3g}, ratio {rel:.3g} (bound {tol:g}); same argmax at {same_argmax:.0%} of positions; "
          f"routing: {first.choices} choices, smallest top-k logit margin {first.min_margin:.3g}, "
          f"{len(first.ties)} near ties{sw}")
    sys.exit(0 if rel <= tol else 1)


if __name__ == "__main__":
    main()
