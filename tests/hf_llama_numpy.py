"""The Hugging Face Llama forward (LlamaForCausalLM) in NumPy, from HF's published model
definition (transformers' modeling_llama.py: LlamaRMSNorm, LlamaRotaryEmbedding with
rotate_half, causal softmax attention, LlamaMLP), written without looking at meshtrain's
code: it reads only an exported folder's config.json and model.safetensors (parsed here;
no safetensors or torch package), so it checks `meshtrain export` the way transformers
would load it. Computes in float64.

usage: /usr/bin/python3 tests/hf_llama_numpy.py DIR LOGITS.bin ID...
  LOGITS.bin: the fp32 [T, V] logits meshtrain gives for ID... (tests/dump_logits).
  Prints the comparison; exit 0 when max|meshtrain - hf| <= TOL * max|hf| (TOL = 1e-4,
  or $HF_TOL), 1 when not, 2 when the folder is malformed.
"""
import json
import os
import struct
import sys

import numpy as np


PROG = "hf_llama_numpy"  # the name fail() gives (tests/hf_moe_numpy.py, which imports this, gives its own)


def fail(msg, code=2):
    print(f"{PROG}: {msg}")
    sys.exit(code)


def read_safetensors(path):
    """{name: float32 array}, after checking the header as a strict reader would."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        fail(f"{path}: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        fail(f"{path}: header length {n} runs past the file")
    if n % 8:
        fail(f"{path}: header length {n} is not a multiple of 8")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{path}: header is not valid JSON ({e})")
    meta = header.pop("__metadata__", None)
    if meta != {"format": "pt"}:
        fail(f"{path}: __metadata__ is {meta!r}, expected {{'format': 'pt'}}")
    data = raw[8 + n:]
    spans, tensors = [], {}
    for name, t in header.items():
        if t.get("dtype") != "F32":
            fail(f"{path}: {name} has dtype {t.get('dtype')}, expected F32")
        begin, end = t["data_offsets"]
        count = int(np.prod(t["shape"], dtype=np.int64))
        if end - begin != 4 * count:
            fail(f"{path}: {name}: data_offsets {begin}..{end} do not hold shape {t['shape']}")
        spans.append((begin, end, name))
        tensors[name] = np.frombuffer(data, dtype="<f4", count=count, offset=begin).reshape(t["shape"])
    # the data must be covered exactly, without gaps or overlaps
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            fail(f"{path}: {name} starts at {begin}, expected {pos}")
        pos = end
    if pos != len(data):
        fail(f"{path}: tensors end at {pos}; the data are {len(data)} bytes")
    return tensors


def rms_norm(x, w, eps):  # LlamaRMSNorm
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return w * (x / np.sqrt(variance + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def rope_cos_sin(T, head_dim, theta):  # LlamaRotaryEmbedding (default rope_type)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    freqs = np.outer(np.arange(T, dtype=np.float64), inv_freq)
    emb = np.concatenate((freqs, freqs), axis=-1)
    return np.cos(emb), np.sin(emb)


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x):
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def swiglu_mlp(W, p, h):  # LlamaMLP, and each expert of the MoE classes
    g = lambda name: W[name].astype(np.float64)
    return (silu(h @ g(p + "gate_proj.weight").T) * (h @ g(p + "up_proj.weight").T)) @ g(p + "down_proj.weight").T


def llama_mlp(W, p, h):
    return swiglu_mlp(W, p + "mlp.", h)


def forward(cfg, W, ids, mlp=llama_mlp, qkv_bias=False):
    """LlamaForCausalLM logits [T, V] for one sequence. The classes built on Llama's decoder
    (tests/hf_moe_numpy.py) give their own mlp(W, "model.layers.{i}.", h) -> [T, E] and
    whether q, k and v have biases."""
    g = lambda name: W[name].astype(np.float64)
    b = lambda name: g(name) if qkv_bias else 0.0
    E, nh, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", E // nh)
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    T = len(ids)
    x = g("model.embed_tokens.weight")[ids]                      # [T, E]
    cos, sin = rope_cos_sin(T, hd, theta)                        # [T, hd]
    mask = np.triu(np.full((T, T), -np.inf), k=1)                # causal
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms_norm(x, g(p + "input_layernorm.weight"), eps)
        proj = lambda name, heads: (h @ g(p + f"self_attn.{name}.weight").T + b(p + f"self_attn.{name}.bias")
                                    ).reshape(T, heads, hd).transpose(1, 0, 2)
        q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=0)                      # repeat_kv
        v = np.repeat(v, nh // nkv, axis=0)
        att = softmax(q @ k.transpose(0, 2, 1) * hd ** -0.5 + mask)
        o = (att @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        x = x + o @ g(p + "self_attn.o_proj.weight").T
        h = rms_norm(x, g(p + "post_attention_layernorm.weight"), eps)
        x = x + mlp(W, p, h)
    x = rms_norm(x, g("model.norm.weight"), eps)
    if cfg.get("tie_word_embeddings", True):  # PretrainedConfig's default is tied
        if "lm_head.weight" in W:
            fail("tie_word_embeddings is true but the file has lm_head.weight")
        head = g("model.embed_tokens.weight")
    else:
        if "lm_head.weight" not in W:
            fail("tie_word_embeddings is false and the file has no lm_head.weight")
        head = g("lm_head.weight")
    return x @ head.T


def main():
    if len(sys.argv) < 4:
        fail(__doc__.strip().splitlines()[-4])
    d, logits_path, ids = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
    try:
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"config.json: {e}")
    if cfg.get("model_type") != "llama" or cfg.get("architectures") != ["LlamaForCausalLM"]:
        fail("config.json is not a LlamaForCausalLM's")
    W = read_safetensors(os.path.join(d, "model.safetensors"))
    want = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(cfg["num_hidden_layers"]) for n in
        ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
         "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    if not cfg.get("tie_word_embeddings", True):
        want.add("lm_head.weight")
    if set(W) != want:
        fail(f"tensors missing: {sorted(want - set(W))}, unexpected: {sorted(set(W) - want)}")
    hf = forward(cfg, W, ids)
    mt = np.fromfile(logits_path, dtype="<f4").astype(np.float64)
    if mt.size != hf.size:
        fail(f"{logits_path} holds {mt.size} logits; the model gives {hf.size}")
    mt = mt.reshape(hf.shape)
    tol = float(os.environ.get("HF_TOL", "1e-4"))
    diff, scale = np.max(np.abs(mt - hf)), np.max(np.abs(hf))
    same_argmax = np.mean(np.argmax(mt, -1) == np.argmax(hf, -1))
    rel = diff / scale
    print(f"{len(W)} tensors, logits [{hf.shape[0]}, {hf.shape[1]}]: max |meshtrain - hf| = {diff:.3g}, "
          f"max |hf| = {scale:.3g}, ratio {rel:.3g} (bound {tol:g}); same argmax at {same_argmax:.0%} of positions")
    sys.exit(0 if rel <= tol else 1)


if __name__ == "__main__":
    main()
