"""Writes tests/fixtures/moe_small.bin: a small mixture-of-experts model's logits, losses,
gradients and 5 AdamW steps, computed in fp32 by the PyTorch reference model
(../shared/peers/torch_llama.py with moe_experts, its per-expert loop path), for tests/test_moe.c.

Run from the repository root: python3 tests/gen_moe_fixture.py  (needs torch and numpy; PEERS_DIR=
the folder of torch_llama.py where it is not ../shared/peers).
The loss the gradients and steps are of is the reference's: the cross-entropy plus moe_aux times
the sum over the layers of the Switch load-balancing loss. File layout (little-endian):
  int32 x 14: magic 0x454F4D4D ('MMOE'), version 1, V, E, NH, L, T, B, X, top_k, expert_dim,
              shared, n_steps, 0
  float32 aux_weight
  int32 tokens [n_steps, B, T+1]     (step 0's batch is the one for logits/losses/grads)
  float32 params [n_params]          (meshtrain's tensor order: tok_embed; per layer att_norm,
                                      qkv, att_out, ffn_norm, router, shared gate/up/down, then
                                      each expert's gate, up, down; output_norm, lm_head)
  float32 logits [B, T, V], float32 ce_loss, float32 aux (the sum over layers, unweighted)
  float32 grads [n_params]
  float32 step_losses [n_steps]      (cross-entropy before each AdamW update)
  float32 final_params [n_params]
  AdamW: lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad clip 1.0.
"""
import os, struct, sys
import numpy as np
import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
# the reference program's folder: PEERS_DIR, else ../shared/peers beside the repository
sys.path.insert(0, os.environ.get("PEERS_DIR", os.path.join(here, "..", "..", "shared", "peers")))
import torch_llama  # noqa: E402


def make(path, V, E, NH, L, T, B, X, k, H, S, aux_w=0.01, n_steps=5, seed=0):
    torch_llama.cfg.update(moe_experts=X, moe_top_k=k, moe_expert_dim=H, moe_shared=S, moe_aux=aux_w,
                           moe_impl="loop")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = torch_llama.LanguageModel(V, T, E, NH, L).float()
    params = dict(model.named_parameters())
    # meshtrain's tensors, each as a view of a reference parameter
    views = [("tok_embed", params["tok_embed.weight"])]
    for l in range(L):
        b = f"blocks.{l}."
        views += [(b + "att_norm", params[b + "att_norm.w"]), (b + "qkv", params[b + "qkv_proj.weight"]),
                  (b + "att_out", params[b + "att_out_proj.weight"]), (b + "ffn_norm", params[b + "ffn_norm.w"]),
                  (b + "router", params[b + "ffn.router.weight"])]
        if S:
            views += [(b + "sg", params[b + "ffn.shared.gate_proj.weight"]),
                      (b + "su", params[b + "ffn.shared.up_proj.weight"]),
                      (b + "sd", params[b + "ffn.shared.down_proj.weight"])]
        w13, w2 = params[b + "ffn.w13"], params[b + "ffn.w2"]
        for e in range(X):
            views += [(f"{b}e{e}g", (w13, e, 0)), (f"{b}e{e}u", (w13, e, 1)), (f"{b}e{e}d", (w2, e, None))]
    views += [("output_norm", params["output_norm.w"]), ("lm_head", params["lm_head.weight"])]

    def get(v, src):
        if not isinstance(v, tuple):
            return src(v)
        p, e, half = v
        t = src(p)[e]
        return t if half is None else t[half * H:(half + 1) * H]

    with torch.no_grad():
        for name, v in views:
            t = get(v, lambda p: p)
            val = (1.0 + 0.1 * rng.standard_normal(t.shape)) if name.endswith("norm") else 0.1 * rng.standard_normal(t.shape)
            t.copy_(torch.from_numpy(val.astype(np.float32)))
    flat = lambda src: np.concatenate([get(v, src).detach().numpy().reshape(-1) for _, v in views]).astype(np.float32)
    p0 = flat(lambda p: p)
    tokens = rng.integers(0, V, size=(n_steps, B, T + 1)).astype(np.int32)
    moe_layers = [m for m in model.modules() if isinstance(m, torch_llama.MoE)]

    def loss_of(batch):
        idx = torch.from_numpy(batch[:, :-1].astype(np.int64))
        tgt = torch.from_numpy(batch[:, 1:].astype(np.int64))
        logits = model(idx)
        ce = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
        aux = sum(m.aux for m in moe_layers)
        return logits, ce, aux

    logits, ce, aux = loss_of(tokens[0])
    (ce + aux_w * aux).backward()
    grads = flat(lambda p: p.grad)
    logits = logits.detach().numpy().astype(np.float32)
    ce0, aux0 = float(ce), float(aux)
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    step_losses = []
    for s in range(n_steps):
        opt.zero_grad(set_to_none=True)
        _, ce, aux = loss_of(tokens[s])
        (ce + aux_w * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_losses.append(float(ce))
    final = flat(lambda p: p)

    with open(path, "wb") as f:
        f.write(struct.pack("<14i", 0x454F4D4D, 1, V, E, NH, L, T, B, X, k, H, S, n_steps, 0))
        f.write(struct.pack("<f", aux_w))
        f.write(tokens.tobytes())
        f.write(p0.tobytes())
        f.write(logits.tobytes())
        f.write(struct.pack("<2f", ce0, aux0))
        f.write(grads.tobytes())
        f.write(np.array(step_losses, dtype=np.float32).tobytes())
        f.write(final.tobytes())
    print(f"{path}: {p0.size} params, ce {ce0:.6f}, aux {aux0:.6f}, step losses {[round(x, 6) for x in step_losses]}")


if __name__ == "__main__":
    out = os.path.join(here, "fixtures")
    os.makedirs(out, exist_ok=True)
    make(os.path.join(out, "moe_small.bin"), V=97, E=32, NH=4, L=2, T=16, B=3, X=4, k=2, H=24, S=1)
