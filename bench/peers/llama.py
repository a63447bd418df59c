"""meshtrain's model in PyTorch: the Llama-style decoder of docs (DESIGN.md, "The model").

  tok_embed (V x E) -> n_layers x CausalTransformerLayer -> output_norm -> lm_head (E x V)
  layer: x += att_out_proj(attention(rope(qkv_proj(att_norm(x)))))
         x += down_proj(silu(gate_proj(h)) * up_proj(h)),  h = ffn_norm(x)

qkv_proj is one fused E x 3E matrix; the FFN's hidden size is int(1.5 * E); no biases;
RMSNorm with a weight and eps 1e-5; RoPE base 10000 on interleaved pairs (x[2i], x[2i+1]);
causal softmax attention scaled by 1/sqrt(head_dim); lm_head untied unless tie=True.
E1024 H8 L16 at V=50257 has 245,566,464 parameters (194,103,296 tied).

Optionally every layer's FFN is a mixture of experts (MoE): an fp32 router, softmax, top-k
renormalised, tokens sorted by expert, the experts as grouped products, index_add back.

Importing this module runs nothing. The modules are created, and their weights drawn, in the
order of the reference program (../shared/peers/torch_llama.py), and the forward pass is the
same sequence of operations, so that under the same seed both give the same initial weights
and the same losses, bit for bit (on one kind of device, in one precision).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))  # named as in the reference's state dict
        self.eps = eps

    def forward(self, x):
        # normalised in fp32 whatever x is, then back to x's dtype before the weight
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.w


def rope_cache(T, head_dim, device):
    """cos and sin [T, head_dim / 2] of RoPE with base 10000, in fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    f = torch.outer(torch.arange(T, device=device).float(), inv)
    return f.cos(), f.sin()


def apply_rope(x, cos, sin):
    """Rotates the interleaved pairs (x[..., 2i], x[..., 2i+1]) of x [B, H, T, hd], in fp32."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).to(x.dtype)


class FFN(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), hidden size h (int(1.5 * e))."""

    def __init__(self, e, h=None):
        super().__init__()
        h = h or int(1.5 * e)
        # up before gate: the order the weights are drawn in, as in the reference
        self.up_proj = nn.Linear(e, h, bias=False)
        self.gate_proj = nn.Linear(e, h, bias=False)
        self.down_proj = nn.Linear(h, e, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEConfig:
    """experts: routed experts per layer; top_k: experts per token; expert_dim: each expert's
    hidden size (0: int(1.5 * E) / top_k, the dense FFN's active width); shared: always-on
    experts of that width, run as one FFN; aux: weight of the Switch load-balancing loss;
    impl: "grouped" (torch._grouped_mm, GPU) or "loop" (one product per expert)."""

    def __init__(self, experts, top_k=2, expert_dim=0, shared=0, aux=0.01, impl="grouped"):
        if impl not in ("grouped", "loop"):
            raise ValueError(f"moe_impl={impl}: must be grouped or loop")
        if not 1 <= top_k <= experts:
            raise ValueError(f"moe_top_k={top_k}: must be between 1 and moe_experts={experts}")
        self.experts, self.top_k, self.expert_dim = experts, top_k, expert_dim
        self.shared, self.aux, self.impl = shared, aux, impl

    def hidden(self, e):
        return self.expert_dim or int(1.5 * e) // self.top_k


# Rows per expert group are rounded up to this, so that every group of the grouped weight
# gradient starts 16-byte aligned (what torch._grouped_mm asks of bf16 operands).
ALIGN = 8


class MoE(nn.Module):
    """Top-k routed experts (SwiGLU each) plus optional shared experts. After forward,
    self.aux holds this layer's load-balancing loss (unweighted)."""

    def __init__(self, e, cfg):
        super().__init__()
        self.n_exp, self.k, self.h, self.impl = cfg.experts, cfg.top_k, cfg.hidden(e), cfg.impl
        self.router = nn.Linear(e, self.n_exp, bias=False)
        self.w13 = nn.Parameter(torch.randn(self.n_exp, 2 * self.h, e) * 0.02)  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.randn(self.n_exp, e, self.h) * 0.02)
        self.shared = FFN(e, self.h * cfg.shared) if cfg.shared else None
        self.aux = None

    def experts_loop(self, xs, counts):
        outs, start = [], 0
        for i, c in enumerate(counts.tolist()):
            g, u = (xs[start:start + c] @ self.w13[i].t()).chunk(2, -1)
            outs.append((F.silu(g) * u) @ self.w2[i].t())
            start += c
        return torch.cat(outs)

    def experts_grouped(self, xs, counts):
        # Each expert's rows are placed at an ALIGN-rounded offset in a buffer with room for
        # the worst case, so the buffer's shape does not depend on the routing.
        n = xs.shape[0]
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        start = torch.cumsum(counts, 0) - counts
        pstart = torch.cumsum(padded, 0) - padded
        exp_of = torch.repeat_interleave(torch.arange(self.n_exp, device=xs.device), counts, output_size=n)
        pos = pstart[exp_of] + torch.arange(n, device=xs.device) - start[exp_of]
        bf = torch.bfloat16  # grouped_mm takes bf16 operands, and autocast does not cast them
        xp = xs.new_zeros(n + self.n_exp * ALIGN, xs.shape[1], dtype=bf).index_copy(0, pos, xs.to(bf))
        offs = torch.cumsum(padded, 0).to(torch.int32)
        g, u = torch._grouped_mm(xp, self.w13.to(bf).transpose(-2, -1), offs=offs).chunk(2, -1)
        return torch._grouped_mm(F.silu(g) * u, self.w2.to(bf).transpose(-2, -1), offs=offs)[pos].to(xs.dtype)

    def forward(self, x):
        B, T, E = x.shape
        x = x.reshape(-1, E)
        probs = F.softmax(self.router(x).float(), -1)
        w, idx = probs.topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        flat = idx.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tok = order // self.k
        counts = torch.bincount(flat, minlength=self.n_exp)
        experts = self.experts_loop if self.impl == "loop" else self.experts_grouped
        y = experts(x[tok], counts) * w.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tok, y)
        self.aux = self.n_exp * (counts.float() / flat.numel() * probs.mean(0)).sum()
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(B, T, E)

    def inactive_params(self):
        """Routed-expert weights a token does not use (for active-parameter counts)."""
        return (self.w13.numel() + self.w2.numel()) * (1 - self.k / self.n_exp)


class CausalTransformerLayer(nn.Module):
    def __init__(self, e, n_heads, moe=None):
        super().__init__()
        if e % n_heads:
            raise ValueError(f"n_heads={n_heads} does not divide embed_dim={e}")
        self.nh = n_heads
        self.qkv_proj = nn.Linear(e, 3 * e, bias=False)  # q rows, then k, then v
        self.att_out_proj = nn.Linear(e, e, bias=False)
        self.att_norm = RMSNorm(e)
        self.ffn_norm = RMSNorm(e)
        self.ffn = MoE(e, moe) if moe else FFN(e)

    def forward(self, x, cos, sin):
        B, T, E = x.shape
        q, k, v = self.qkv_proj(self.att_norm(x)).split(E, dim=-1)
        q, k, v = [t.view(B, T, self.nh, E // self.nh).transpose(1, 2) for t in (q, k, v)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(head_dim)
        x = x + self.att_out_proj(a.transpose(1, 2).reshape(B, T, E))
        return x + self.ffn(self.ffn_norm(x))


class LanguageModel(nn.Module):
    """LanguageModel(V, T, E, n_heads, n_layers): the reference's signature; T is the context
    length (RoPE is computed for the input's length). tie: lm_head shares tok_embed's weight;
    moe: a MoEConfig for every layer's FFN; ckpt: recompute each layer in the backward."""

    def __init__(self, V, T, e, n_heads, n_layers, tie=False, moe=None, ckpt=False):
        super().__init__()
        self.tok_embed = nn.Embedding(V, e)
        self.blocks = nn.ModuleList([CausalTransformerLayer(e, n_heads, moe) for _ in range(n_layers)])
        self.output_norm = RMSNorm(e)
        self.lm_head = nn.Linear(e, V, bias=False)  # drawn even when tied: keeps the RNG in step
        if tie:
            self.lm_head.weight = self.tok_embed.weight
        self.T, self.hd, self.ckpt = T, e // n_heads, ckpt

    def forward(self, idx):
        x = self.tok_embed(idx)
        cos, sin = rope_cache(idx.shape[1], self.hd, idx.device)
        for b in self.blocks:
            if self.ckpt:
                x = torch.utils.checkpoint.checkpoint(b, x, cos, sin, use_reentrant=False)
            else:
                x = b(x, cos, sin)
        return self.lm_head(self.output_norm(x))

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]


def flops_per_token(model, V, E, L, T):
    """Training FLOPs per token, PaLM-style: 6 x the active matmul parameters (the embedding
    lookup is no matmul; when tied, its matrix still works as lm_head) + 12 L E T for the
    attention scores (counted without the causal half), as the reference counts them."""
    n = sum(p.numel() for p in model.parameters())
    n -= sum(m.inactive_params() for m in model.moe_layers())
    tied = model.lm_head.weight is model.tok_embed.weight
    return 6 * (n - (0 if tied else V * E)) + 12 * L * E * T
