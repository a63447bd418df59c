"""Pipeline parallel training of bench/peers/llama.py with torch.distributed.pipelining.

  torchrun --nproc_per_node=P bench/peers/train_pp.py embed_dim=1024 n_heads=8 n_layers=16 \
      batch_size=128 context_len=256 micro_batches=8 schedule=1f1b [compile=1] [steps=20]

schedule: gpipe | 1f1b | interleaved (2 stages per rank, looped: rank r holds stages r and
r + P) | zbv (2 stages per rank in a V: r and 2P - 1 - r; zero bubble). batch_size is the
whole pipeline's batch per step (one data-parallel replica), cut into micro_batches
micro-batches; the schedule averages the micro-batches' gradients. The layers are split
evenly over the stages; the embedding rides with the first stage, output_norm and lm_head
with the last. compile=1 compiles each layer (as torchtitan does; a whole stage does not
compile under the schedule). Pure bf16 on a GPU, fp32 on a CPU (gloo); AdamW lr=3e-4
(fused) over each rank's parameters. Random tokens seeded 1234 on every rank.

Every rank builds the whole model under seed 0, exactly as bench/peers/train.py does, and
keeps its stages' modules: so the initial weights are train.py's and step 1's loss is
train.py's at batch_size (up to the order of the micro-batch mean). (The reference program,
../shared/peers/torch_llama_pp.py, builds each stage from seed 0 on its own, so its stages'
weights differ from the one-process model's.)

Prints one JSON line: tokens/s = steps x batch_size x context_len / elapsed after warm-up,
the largest peak memory of any rank, the last step's loss and the first's (loss_step1).
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
from llama import LanguageModel, rope_cache  # noqa: E402

PROG = "train_pp.py"
DEFAULTS = dict(embed_dim=1024, n_heads=8, n_layers=16, batch_size=128, context_len=256,
                micro_batches=8, schedule="1f1b", compile=0, steps=20, warmup=3, vocab=50257,
                device="auto", fp32="auto", log_every=0)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
CHOICES = dict(schedule=SCHEDULES, compile=(0, 1), device=("auto", "cuda", "cpu"), fp32=("auto", "0", "1"))


class Stage(nn.Module):
    """Layers [lo, hi) of a LanguageModel, with its embedding on the first stage and its
    head on the last."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.tok_embed = model.tok_embed if first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.output_norm = model.output_norm if last else None
        self.lm_head = model.lm_head if last else None
        self.hd = model.hd

    def forward(self, x):
        if self.tok_embed is not None:
            x = self.tok_embed(x)
        cos, sin = rope_cache(x.shape[1], self.hd, x.device)
        for b in self.blocks:
            x = b(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.output_norm(x))
        return x


def stages_of(rank, P, schedule):
    """The stage ids a rank holds, and the number of stages."""
    if schedule in ("gpipe", "1f1b"):
        return [rank], P
    return ([rank, rank + P] if schedule == "interleaved" else [rank, 2 * P - 1 - rank]), 2 * P


def max_over_ranks(x, dev):
    """The largest x over the ranks; None counts as 0 (a loss is > 0, so MAX finds the
    last stage's)."""
    t = torch.tensor([0.0 if x is None else float(x)], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv):
    cfg = parse_keys(PROG, DEFAULTS, argv, CHOICES)
    positive(PROG, cfg, "embed_dim", "n_heads", "n_layers", "batch_size", "context_len", "micro_batches",
             "steps", "warmup", "vocab", "log_every", zero=("warmup", "log_every"))
    E, H, L, B, T, V = (cfg[k] for k in ("embed_dim", "n_heads", "n_layers", "batch_size", "context_len", "vocab"))
    m, schedule = cfg["micro_batches"], cfg["schedule"]
    check(PROG, E % H == 0 and (E // H) % 2 == 0, f"n_heads={H}: must divide embed_dim={E} into an even head_dim")
    check(PROG, B % m == 0, f"micro_batches={m}: must divide batch_size={B}")
    if "LOCAL_RANK" not in os.environ:
        fail(PROG, "run under torchrun (torchrun --nproc_per_node=2 ...)")
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    env = Env(PROG, cfg["device"])
    P = env.world
    ids, S = stages_of(env.rank, P, schedule)
    check(PROG, L % S == 0, f"n_layers={L}: must divide into {S} stages ({schedule} on {P} ranks)")
    fp32 = cfg["fp32"] == "1" or (cfg["fp32"] == "auto" and not env.cuda)

    torch.manual_seed(0)
    with default_dtype(torch.float32 if fp32 else torch.bfloat16), env.dev:
        model = LanguageModel(V, T, E, H, L)
    per = L // S
    mods = [Stage(model, s * per, (s + 1) * per, s == 0, s == S - 1) for s in ids]
    del model  # the other stages' weights go with it
    if env.cuda:
        torch.cuda.empty_cache()
    if cfg["compile"]:
        for mod in mods:
            for b in mod.blocks:
                b.compile()
    stages = [PipelineStage(mod, s, S, env.dev) for mod, s in zip(mods, ids)]
    params = [p for mod in mods for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, fused=True)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1))

    if len(stages) == 1:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], n_microbatches=m, loss_fn=loss_fn)
    else:
        cls = {"interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}[schedule]
        sched = cls(stages, n_microbatches=m, loss_fn=loss_fn)
    has_first, has_last = 0 in ids, S - 1 in ids
    data = Batches(V, B, T, 0, env.dev)

    def step():
        batch = data.next()
        opt.zero_grad(set_to_none=True)
        losses = []
        args = (batch[:, :-1].contiguous(),) if has_first else ()
        kw = dict(target=batch[:, 1:].contiguous(), losses=losses) if has_last else {}
        sched.step(*args, **kw)
        opt.step()
        return sum(losses) / len(losses) if losses else None  # on the ranks holding the last stage

    loss_step1 = None
    for n in range(1, cfg["warmup"] + cfg["steps"] + 1):
        if n == cfg["warmup"] + 1:
            env.sync()
            env.reset_peak()
            dist.barrier()
            t0 = clock()
        loss = step()
        if n == 1 and loss is not None:
            loss_step1 = float(loss)
        if cfg["log_every"] and n % cfg["log_every"] == 0:
            lt = max_over_ranks(loss, env.dev)
            if env.rank == 0:
                print(json.dumps(dict(step=n, loss=lt)), flush=True)
    env.sync()
    dist.barrier()
    dt = clock() - t0
    peak = max_over_ranks(env.peak_gb(), env.dev)
    loss, loss_step1 = max_over_ranks(loss, env.dev), max_over_ranks(loss_step1, env.dev)
    nparams = torch.tensor([sum(p.numel() for p in params)], device=env.dev, dtype=torch.float64)
    dist.all_reduce(nparams)
    tok_s = cfg["steps"] * B * T / dt
    flops_tok = 6 * (nparams.item() - V * E) + 12 * L * E * T
    if env.rank == 0:
        print(json.dumps(dict(cfg=cfg, params=int(nparams.item()), world=P, tokens_per_s=round(tok_s),
                              step_ms=round(1000 * dt / cfg["steps"], 2), peak_mem_gb_max_rank=round(peak, 2),
                              tflops_per_gpu=round(tok_s / P * flops_tok / 1e12, 1), loss=loss,
                              loss_step1=loss_step1, device=env.dev.type)), flush=True)
    env.close()


if __name__ == "__main__":
    main(sys.argv[1:])
