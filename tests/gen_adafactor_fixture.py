"""Writes tests/fixtures/adafactor.bin: Adafactor steps (Shazeer & Stern 2018, as Hugging Face
transformers' Adafactor computes them) in float64, for tests/test_optim.c.

Run from the repository root: /usr/bin/python3 tests/gen_adafactor_fixture.py (needs numpy only,
which scripts/install-deps.sh installs for /usr/bin/python3).
Each case updates the tensors of a tiny model (vocab_size 13, embed_dim 8, 2 heads, 1 layer,
untied: model_tensors' order and shapes, so that the test runs them through the optimizer
layer's interface over the model's flat units; matrices: factored second moments; the
norms, 1 x n vectors: the unfactored one) for n_steps steps from numpy-seeded parameters and
gradients, with a constant learning rate (or the relative step). File layout (little-endian):
  int32 x 2: magic 0x58464641 ('AFFX'), n_cases
  per case:
    int32 x 5: n_tensors, n_steps, relative_step, scale_parameter, pad (0)
    float64 x 6: lr, beta1 (0: no first moment), clip_threshold, decay_rate, weight_decay, grad_scale
    per tensor: int32 rows, cols; float64 params [rows * cols]
    per step, per tensor: float64 grads [rows * cols]  (before grad_scale)
    per tensor: float64 final params [rows * cols]
"""
import os, struct
import numpy as np

EPS1, EPS2 = 1e-30, 1e-3


def rms(x):
    return np.sqrt(np.mean(x * x))


def step(p, g, st, t, c):
    """One update of tensor p (2-D) in place; st holds its state. As HF Adafactor.step."""
    rows, cols = p.shape
    factored = rows > 1
    beta2t = 1.0 - t ** (-c["decay"])
    rel = min(1e-2, 1.0 / np.sqrt(t)) if c["relative"] else c["lr"]
    lr = rel * (max(EPS2, rms(p)) if c["scale"] else 1.0)
    g2 = g * g + EPS1
    if factored:
        st["r"] = beta2t * st["r"] + (1 - beta2t) * g2.mean(axis=1)
        st["c"] = beta2t * st["c"] + (1 - beta2t) * g2.mean(axis=0)
        rf = 1.0 / np.sqrt(st["r"] / st["r"].mean())
        cf = 1.0 / np.sqrt(st["c"])
        u = g * rf[:, None] * cf[None, :]
    else:
        st["v"] = beta2t * st["v"] + (1 - beta2t) * g2
        u = g / np.sqrt(st["v"])
    u = u / max(1.0, rms(u) / c["clip"])
    u = u * lr
    if c["beta1"] > 0:
        st["m"] = c["beta1"] * st["m"] + (1 - c["beta1"]) * u
        u = st["m"]
    if c["wd"] != 0:
        p += p * (-c["wd"] * lr)
    p -= u


def case(rng, shapes, n_steps, **c):
    params = [0.05 * rng.standard_normal(s) if s[0] > 1 else 1.0 + 0.1 * rng.standard_normal(s) for s in shapes]
    grads = [[rng.standard_normal(s) * (10.0 ** rng.uniform(-4, -1)) for s in shapes] for _ in range(n_steps)]
    for k in range(n_steps):  # a row and a column that get no gradient (unused embedding rows)
        grads[k][0][1, :] = 0.0
    state = [dict(r=np.zeros(s[0]), c=np.zeros(s[1]), v=np.zeros(s), m=np.zeros(s)) for s in shapes]
    p = [x.copy() for x in params]
    for t in range(1, n_steps + 1):
        for i in range(len(shapes)):
            step(p[i], grads[t - 1][i] * c["scale_g"], state[i], t, c)
    out = struct.pack("<5i", len(shapes), n_steps, int(c["relative"]), int(c["scale"]), 0)
    out += struct.pack("<6d", c["lr"], c["beta1"], c["clip"], c["decay"], c["wd"], c["scale_g"])
    for s, x in zip(shapes, params):
        out += struct.pack("<2i", *s) + x.astype("<f8").tobytes()
    for k in range(n_steps):
        for x in grads[k]:
            out += x.astype("<f8").tobytes()
    for x in p:
        out += x.astype("<f8").tobytes()
    return out


def main():
    rng = np.random.default_rng(21)
    # tok_embed, att_norm, qkv_proj, att_out_proj, ffn_norm, gate_proj, up_proj, down_proj, output_norm, lm_head
    shapes = [(13, 8), (1, 8), (24, 8), (8, 8), (1, 8), (12, 8), (12, 8), (8, 12), (1, 8), (13, 8)]
    cases = [
        case(rng, shapes, 6, lr=1e-2, beta1=0.0, clip=1.0, decay=0.8, wd=0.0, scale_g=1.0, relative=0, scale=0),
        case(rng, shapes, 6, lr=0.0, beta1=0.9, clip=1.0, decay=0.8, wd=0.01, scale_g=0.5, relative=1, scale=1),
        case(rng, shapes, 5, lr=3e-3, beta1=0.0, clip=0.05, decay=0.6, wd=0.1, scale_g=1.0, relative=0, scale=1),
    ]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "adafactor.bin")
    with open(path, "wb") as f:
        f.write(struct.pack("<2i", 0x58464641, len(cases)) + b"".join(cases))
    print(path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
