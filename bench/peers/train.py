"""Trains bench/peers/llama.py (meshtrain's model) on random tokens and measures it: the
PyTorch side of meshtrain's benchmarks, one GPU, DDP or FSDP.

  python3 bench/peers/train.py embed_dim=1024 n_heads=8 n_layers=16 batch_size=128 context_len=256 compile=1
  torchrun --nproc_per_node=2 bench/peers/train.py ...            DDP (batch_size per rank)
  torchrun --nproc_per_node=2 bench/peers/train.py ... fsdp=1     FSDP, full shard, one unit per layer

Precision on a GPU: pure bf16 (parameters, gradients, AdamW state; the post's setup) by
default; amp=1 keeps fp32 parameters and runs the model under bf16 autocast. On a CPU
(device=cpu, or no GPU) everything is fp32 (fp32=0 there gives the GPU's dtypes instead).
AdamW lr=3e-4 (fused), no clipping, no schedule.

The seed, the initialisation and the data are those of the reference program
(../shared/peers/torch_llama.py): torch.manual_seed(0) then the model built on the device in
its dtype, and random tokens from a CPU generator seeded 1234 + rank. The same keys (and the
same defaults) are accepted, and the summary is the same JSON line with the same fields, plus
loss_step1 (rank 0's loss at the first step, warm-up included) and device.

Measured: tokens/s = steps x world x batch_size x context_len / elapsed, over the `steps`
steps after `warmup` untimed ones; peak memory is the GPU allocator's high-water mark over
the timed steps (on a CPU, the process's max RSS). tflops_per_gpu counts 6 x active matmul
parameters + 12 L E T per token.

Keys beyond the reference's: device=auto|cuda|cpu, fp32=auto|0|1, tie_embeddings=0|1 (lm_head
shares tok_embed's weight, drawn N(0, 1) by PyTorch's default, so the loss starts high: a
setting for throughput, not for training), log_every=N (rank 0 prints step N's loss, and its mean over the data-parallel ranks, every N
steps), data_ranks=N (one process draws the batches that N data-parallel ranks would and
trains on them as one batch: the one-process run that DDP's loss curve should follow).
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Batches, Env, check, clock, default_dtype, parse_keys, positive  # noqa: E402
from llama import CausalTransformerLayer, LanguageModel, MoEConfig, flops_per_token  # noqa: E402

PROG = "train.py"
DEFAULTS = dict(embed_dim=1024, n_heads=8, n_layers=16, batch_size=128, context_len=256,
                compile=0, steps=10, warmup=3, amp=0, fsdp=0, vocab=50257, ckpt=0,
                moe_experts=0, moe_top_k=2, moe_expert_dim=0, moe_shared=0, moe_aux=0.01,
                moe_impl="grouped",
                device="auto", fp32="auto", tie_embeddings=0, log_every=0, data_ranks=1)
FLAGS = ("compile", "amp", "fsdp", "ckpt", "tie_embeddings")
CHOICES = dict(moe_impl=("grouped", "loop"), device=("auto", "cuda", "cpu"), fp32=("auto", "0", "1"),
               **{k: (0, 1) for k in FLAGS})


def validate(cfg, env):
    positive(PROG, cfg, "embed_dim", "n_heads", "n_layers", "batch_size", "context_len", "steps",
             "warmup", "vocab", "moe_experts", "moe_expert_dim", "moe_shared", "log_every", "data_ranks",
             zero=("warmup", "moe_experts", "moe_expert_dim", "moe_shared", "log_every"))
    E, H = cfg["embed_dim"], cfg["n_heads"]
    check(PROG, E % H == 0, f"n_heads={H}: must divide embed_dim={E}")
    check(PROG, (E // H) % 2 == 0, f"n_heads={H}: head_dim {E // H} must be even (RoPE rotates pairs)")
    check(PROG, cfg["vocab"] >= 2, f"vocab={cfg['vocab']}: must be >= 2")
    if cfg["moe_experts"]:
        check(PROG, 1 <= cfg["moe_top_k"] <= cfg["moe_experts"],
              f"moe_top_k={cfg['moe_top_k']}: must be between 1 and moe_experts={cfg['moe_experts']}")
    check(PROG, not cfg["fsdp"] or env.distributed, "fsdp=1: run under torchrun")
    check(PROG, cfg["data_ranks"] == 1 or env.world == 1, "data_ranks: only for one process (world 1)")


def main(argv):
    cfg = parse_keys(PROG, DEFAULTS, argv, CHOICES)
    env = Env(PROG, cfg["device"])
    validate(cfg, env)
    E, H, L, B, T, V = (cfg[k] for k in ("embed_dim", "n_heads", "n_layers", "batch_size", "context_len", "vocab"))
    fp32 = cfg["fp32"] == "1" or (cfg["fp32"] == "auto" and not env.cuda)
    autocast = bool(cfg["amp"]) and not fp32
    moe = MoEConfig(cfg["moe_experts"], cfg["moe_top_k"], cfg["moe_expert_dim"], cfg["moe_shared"],
                    cfg["moe_aux"], cfg["moe_impl"]) if cfg["moe_experts"] else None

    torch.manual_seed(0)
    # Built on the device, in the dtype it trains in: no host copy, and the same draws as the reference.
    with default_dtype(torch.float32 if fp32 or autocast else torch.bfloat16), env.dev:
        model = LanguageModel(V, T, E, H, L, tie=bool(cfg["tie_embeddings"]), moe=moe, ckpt=bool(cfg["ckpt"]))
    nparams = sum(p.numel() for p in model.parameters())
    moe_layers = model.moe_layers()
    active = nparams - sum(m.inactive_params() for m in moe_layers)
    flops_tok = flops_per_token(model, V, E, L, T)

    if cfg["fsdp"]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({CausalTransformerLayer}), use_orig_params=True,
                     device_id=env.dev)
    elif env.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    step_model = torch.compile(model) if cfg["compile"] else model
    data = Batches(V, B, T, env.rank * cfg["data_ranks"], env.dev, draws=cfg["data_ranks"])

    def step():
        batch = data.next()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(env.dev.type, dtype=torch.bfloat16, enabled=autocast):
            pred = step_model(batch[:, :-1])
            loss = F.cross_entropy(pred.reshape(-1, V).float(), batch[:, 1:].reshape(-1))
            if moe_layers:
                loss = loss + cfg["moe_aux"] * sum(m.aux for m in moe_layers)
        loss.backward()
        opt.step()
        return loss

    def log(n, loss):
        if not cfg["log_every"] or n % cfg["log_every"]:
            return
        mean = loss.detach().float().clone()
        if env.distributed:
            dist.all_reduce(mean)
            mean /= env.world
        if env.rank == 0:
            print(json.dumps(dict(step=n, loss=float(loss.detach()), loss_global=float(mean))), flush=True)

    loss_step1 = None
    for n in range(1, cfg["warmup"] + cfg["steps"] + 1):
        if n == cfg["warmup"] + 1:  # the timed steps begin
            env.sync()
            env.reset_peak()
            t0 = clock()
        loss = step()
        if n == 1:
            loss_step1 = float(loss.detach())  # a sync, in the warm-up unless warmup=0
        log(n, loss)
    env.sync()
    dt = clock() - t0
    tok_s = cfg["steps"] * env.world * cfg["data_ranks"] * B * T / dt
    if env.rank == 0:
        print(json.dumps(dict(cfg=cfg, params=nparams, active_params=round(active), world=env.world,
                              tokens_per_s=round(tok_s), step_ms=round(1000 * dt / cfg["steps"], 2),
                              peak_mem_gb=round(env.peak_gb(), 2),
                              tflops_per_gpu=round(tok_s / env.world * flops_tok / 1e12, 1),
                              loss=float(loss.detach()), loss_step1=loss_step1, device=env.dev.type)), flush=True)
    env.close()


if __name__ == "__main__":
    main(sys.argv[1:])
