"""Tensor + sequence parallel training of bench/peers/llama.py with PyTorch DTensor, on the
plan of the post's long-context section:

  tok_embed           RowwiseParallel (replicated tokens in, sequence-sharded activations out)
  att_norm, ffn_norm,
  output_norm         SequenceParallel
  attention, ffn      inputs all-gathered along the sequence (PrepareModuleInput)
  q/k/v, gate, up     ColwiseParallel (a rank holds n_heads / tp heads, its FFN columns)
  att_out, down       RowwiseParallel, reduce-scattered back along the sequence
  lm_head             ColwiseParallel, logits gathered (replicated) for the loss

  torchrun --nproc_per_node=2 bench/peers/train_tp.py context_len=10000 embed_dim=1024 n_heads=8 \
      n_layers=16 batch_size=4 [tp=2] [steps=5]

With world > tp the ranks form a (world / tp) x tp mesh; each tensor-parallel group draws its
own batch (seeded 1234 + rank // tp), and dp_sync=1 (the default) averages the gradients over
the groups before AdamW, so that they train one model; dp_sync=0 leaves the groups to train
apart, as the reference program (../shared/peers/torch_llama_tp.py) does. tp=1 is plain DDP
on the same model. Pure bf16 on a GPU (fp32 on a CPU, where gloo carries the collectives),
AdamW lr=3e-4 (foreach). The model is built whole on every rank under seed 0, exactly as
bench/peers/train.py builds it, and qkv_proj is then cut into q_proj, k_proj and v_proj
(column-sharding the fused E x 3E matrix would hand a rank pieces of q, k and v rather than
whole heads): so step 1's loss is train.py's at the same global batch, up to the order of
the sums that tensor parallel splits.

Prints one JSON line: tokens/s = steps x (world / tp) x batch_size x context_len / elapsed
after warm-up, peak memory of rank 0, the last step's loss and the first's (loss_step1).
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Batches, Env, check, clock, default_dtype, fail, parse_keys, positive  # noqa: E402
from llama import LanguageModel, apply_rope  # noqa: E402

PROG = "train_tp.py"
DEFAULTS = dict(embed_dim=1024, n_heads=8, n_layers=16, batch_size=4, context_len=10000,
                steps=5, warmup=2, tp=2, vocab=50257,
                device="auto", fp32="auto", dp_sync=1, log_every=0)
CHOICES = dict(device=("auto", "cuda", "cpu"), fp32=("auto", "0", "1"), dp_sync=(0, 1))


def linear_of(weight):
    """An nn.Linear (no bias) holding `weight` [out, in] as it is (no new draw)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight)
    return lin


class Attention(nn.Module):
    """A layer's attention with its qkv_proj cut into q_proj, k_proj and v_proj."""

    def __init__(self, layer):
        super().__init__()
        E = layer.att_out_proj.in_features
        self.hd = E // layer.nh
        q, k, v = layer.qkv_proj.weight.detach().split(E)
        self.q_proj, self.k_proj, self.v_proj = (linear_of(w.clone()) for w in (q, k, v))
        self.att_out_proj = layer.att_out_proj

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # -1 heads: under tensor parallel a rank's projections give it n_heads / tp heads
        q, k, v = [p(x).view(B, T, -1, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.att_out_proj(a.transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    """llama.CausalTransformerLayer with the attention as a module of its own, which the
    plan can address (its input is gathered along the sequence once, for q, k and v)."""

    def __init__(self, layer):
        super().__init__()
        self.att_norm, self.attention = layer.att_norm, Attention(layer)
        self.ffn_norm, self.ffn = layer.ffn_norm, layer.ffn

    def forward(self, x, cos, sin):
        x = x + self.attention(self.att_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


def parallelize(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    parallelize_module(model, mesh, {
        "tok_embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "output_norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for b in model.blocks:
        parallelize_module(b, mesh, {
            "att_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(),
            "attention.att_out_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.up_proj": ColwiseParallel(), "ffn.gate_proj": ColwiseParallel(),
            "ffn.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })


def average_over(params, group, n):
    """Averages the gradients (their local shards) over `group`, as one flat all-reduce."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= n
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


def main(argv):
    cfg = parse_keys(PROG, DEFAULTS, argv, CHOICES)
    positive(PROG, cfg, "embed_dim", "n_heads", "n_layers", "batch_size", "context_len", "steps", "warmup",
             "tp", "vocab", "log_every", zero=("warmup", "log_every"))
    E, H, L, B, T, V, tp = (cfg[k] for k in ("embed_dim", "n_heads", "n_layers", "batch_size", "context_len",
                                             "vocab", "tp"))
    check(PROG, E % H == 0 and (E // H) % 2 == 0, f"n_heads={H}: must divide embed_dim={E} into an even head_dim")
    check(PROG, H % tp == 0, f"tp={tp}: must divide n_heads={H}")
    check(PROG, T % tp == 0, f"tp={tp}: must divide context_len={T} (sequence parallel splits it)")
    check(PROG, int(1.5 * E) % tp == 0, f"tp={tp}: must divide the FFN width {int(1.5 * E)}")
    if "LOCAL_RANK" not in os.environ:
        fail(PROG, "run under torchrun (torchrun --nproc_per_node=2 ...)")
    env = Env(PROG, cfg["device"])
    check(PROG, env.world % tp == 0, f"tp={tp}: must divide the world size {env.world}")
    fp32 = cfg["fp32"] == "1" or (cfg["fp32"] == "auto" and not env.cuda)
    dp = env.world // tp

    torch.manual_seed(0)
    with default_dtype(torch.float32 if fp32 else torch.bfloat16), env.dev:
        model = LanguageModel(V, T, E, H, L)
    nparams = sum(p.numel() for p in model.parameters())
    model.blocks = nn.ModuleList([Layer(b) for b in model.blocks])
    dp_group = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(env.dev.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        if dp > 1 and cfg["dp_sync"]:
            dp_group = mesh["dp"].get_group()
    else:
        model = nn.parallel.DistributedDataParallel(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, foreach=True)
    data = Batches(V, B, T, env.rank // tp, env.dev)

    def step():
        batch = data.next()
        opt.zero_grad(set_to_none=True)
        pred = model(batch[:, :-1])
        loss = F.cross_entropy(pred.reshape(-1, V).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        if dp_group is not None:
            average_over(params, dp_group, dp)
        opt.step()
        return loss

    loss_step1 = None
    for n in range(1, cfg["warmup"] + cfg["steps"] + 1):
        if n == cfg["warmup"] + 1:
            env.sync()
            env.reset_peak()
            t0 = clock()
        loss = step()
        if n == 1:
            loss_step1 = float(loss.detach())
        if cfg["log_every"] and n % cfg["log_every"] == 0:
            mean = loss.detach().float().clone()  # a tp group's ranks hold the same loss
            dist.all_reduce(mean)
            if env.rank == 0:
                print(json.dumps(dict(step=n, loss=float(loss.detach()), loss_global=float(mean / env.world))),
                      flush=True)
    env.sync()
    dt = clock() - t0
    tok_s = cfg["steps"] * dp * B * T / dt
    if env.rank == 0:
        print(json.dumps(dict(cfg=cfg, params=nparams, world=env.world, tokens_per_s=round(tok_s),
                              step_ms=round(1000 * dt / cfg["steps"], 1), peak_mem_gb=round(env.peak_gb(), 2),
                              loss=float(loss.detach()), loss_step1=loss_step1, device=env.dev.type)), flush=True)
    env.close()


if __name__ == "__main__":
    main(sys.argv[1:])
