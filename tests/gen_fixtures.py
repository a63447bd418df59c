"""Writes tests/fixtures/*.bin: a small model's logits, loss, gradients and 5 AdamW steps,
computed by the PyTorch reference model (../shared/peers/torch_llama.py) in fp32.

Run from the repository root: python3 tests/gen_fixtures.py  (needs torch and numpy).
The weights and tokens come from numpy with a fixed seed; tests/test_model.c loads them into
meshtrain's flat layout by tensor name order and compares. File layout (little-endian):
  int32 x 10: magic 0x5846544d ('MTFX'), version 1, V, E, NH, L, T, B, tie, n_steps
  int32 tokens [n_steps, B, T+1]     (step 0's batch is the one for logits/loss/grads)
  float32 params [n_params]          (model order: tok_embed, blocks.*, output_norm, lm_head)
  float32 logits [B, T, V], float32 loss, float32 grads [n_params]
  float32 step_losses [n_steps]      (loss before each AdamW update, batch k at step k)
  float32 final_params [n_params]    (after n_steps updates)
  AdamW: lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad clip 1.0.
"""
import os, struct, sys
import numpy as np
import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "shared", "peers"))
from torch_llama import LanguageModel  # noqa: E402


def tensor_names(L, tie):
    names = ["tok_embed.weight"]
    for l in range(L):
        names += [f"blocks.{l}.att_norm.w", f"blocks.{l}.qkv_proj.weight", f"blocks.{l}.att_out_proj.weight",
                  f"blocks.{l}.ffn_norm.w", f"blocks.{l}.ffn.gate_proj.weight", f"blocks.{l}.ffn.up_proj.weight",
                  f"blocks.{l}.ffn.down_proj.weight"]
    names.append("output_norm.w")
    if not tie:
        names.append("lm_head.weight")
    return names


def make(path, V, E, NH, L, T, B, tie, n_steps=5, seed=0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = LanguageModel(V, T, E, NH, L).float()
    if tie:
        model.lm_head.weight = model.tok_embed.weight
    params = dict(model.named_parameters())
    names = tensor_names(L, tie)
    assert set(names) == set(params), (set(names) ^ set(params))
    with torch.no_grad():
        for n in names:
            p = params[n]
            if n.endswith("norm.w"):
                val = 1.0 + 0.1 * rng.standard_normal(p.shape)
            else:
                val = 0.05 * rng.standard_normal(p.shape)
            p.copy_(torch.from_numpy(val.astype(np.float32)))
    flat = lambda ts: np.concatenate([t.detach().numpy().reshape(-1) for t in ts]).astype(np.float32)
    p0 = flat(params[n] for n in names)
    tokens = rng.integers(0, V, size=(n_steps, B, T + 1)).astype(np.int32)

    def loss_of(batch):
        idx = torch.from_numpy(batch[:, :-1].astype(np.int64))
        tgt = torch.from_numpy(batch[:, 1:].astype(np.int64))
        logits = model(idx)
        return logits, F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

    logits, loss = loss_of(tokens[0])
    loss.backward()
    grads = flat(params[n].grad for n in names)
    logits = logits.detach().numpy().astype(np.float32)
    loss0 = float(loss)
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    step_losses = []
    for k in range(n_steps):
        opt.zero_grad(set_to_none=True)
        _, loss = loss_of(tokens[k])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_losses.append(float(loss))
    final = flat(params[n] for n in names)

    with open(path, "wb") as f:
        f.write(struct.pack("<10i", 0x5846544D, 1, V, E, NH, L, T, B, int(tie), n_steps))
        f.write(tokens.tobytes())
        f.write(p0.tobytes())
        f.write(logits.tobytes())
        f.write(struct.pack("<f", loss0))
        f.write(grads.tobytes())
        f.write(np.array(step_losses, dtype=np.float32).tobytes())
        f.write(final.tobytes())
    print(f"{path}: {p0.size} params, loss {loss0:.6f}, step losses {[round(x, 6) for x in step_losses]}")


if __name__ == "__main__":
    out = os.path.join(here, "fixtures")
    os.makedirs(out, exist_ok=True)
    make(os.path.join(out, "model_small.bin"), V=97, E=32, NH=4, L=2, T=16, B=3, tie=False)
    make(os.path.join(out, "model_tied.bin"), V=61, E=24, NH=2, L=3, T=9, B=2, tie=True)
