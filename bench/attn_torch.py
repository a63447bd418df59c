"""PyTorch's causal SDPA on its flash and cuDNN backends, the peer of bench_attn.c.

q, k, v are strided views of one bf16 qkv [B, T, 3, H, D] (meshtrain's layout), transposed to
[B, H, T, D] as a model passes them. Forward: scaled_dot_product_attention(is_causal=True);
backward: torch.autograd.grad of the output w.r.t. q, k, v (the SDPA backward kernel, no
accumulation into .grad). Each is timed two ways, as bench_attn times meshtrain's: "events",
the median of triton.testing.do_bench (each call between CUDA events, the L2 cache cleared
before each), and "loop", the median of 7 timings of back-to-back calls (about 50 ms each);
TFLOP/s count causal FLOPs, 4 B H T^2 D / 2 forward and 2.5x that backward. Prints, like
bench_attn:
  RESULT <torch-flash|torch-cudnn> <fwd|bwd> <B> <H> <T> <D> <ms> <TFLOP/s> <loop|events>
Usage: python3 bench/attn_torch.py [B:H:T:D ...]
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

SHAPES = [(128, 8, 256, 128), (32, 8, 1024, 128), (8, 8, 4096, 128), (2, 8, 10000, 128), (8, 16, 4096, 64),
          (16, 16, 1024, 128)]


HOST = {}


def loop_ms(fn):
    """median ms per call over 7 timings of back-to-back calls, as bench_attn's time_call; HOST["ms"]: the
    host's ms per call while queueing the last timing's calls"""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = min(1000, int(0.05 / (time.perf_counter() - t0 + 1e-9)) + 1)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        HOST["ms"] = (time.perf_counter() - t0) / reps * 1e3
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(ts)


def bench(backend, name, B, H, T, D):
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * B * H * T * T * D / 2
    try:
        with sdpa_kernel([backend]):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = fwd()
            bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            bwd()
            torch.cuda.synchronize()
            ms = {"events": (do_bench(fwd, warmup=25, rep=200, return_mode="median"),
                             do_bench(bwd, warmup=25, rep=200, return_mode="median")),
                  "loop": (loop_ms(fwd),)}
            host_f = HOST["ms"]
            ms["loop"] += (loop_ms(bwd),)
            host_b = HOST["ms"]
    except RuntimeError as e:
        print(f"SKIP {name} {B} {H} {T} {D} ({str(e).splitlines()[0][:120]})", flush=True)
        return
    for d, host, loop in (("fwd", host_f, ms["loop"][0]), ("bwd", host_b, ms["loop"][1])):
        print(f"info {name} {d} B={B} NH={H} T={T} HD={D}: the host {host * 1e3:.1f} us a call queueing the loop "
              f"({100 * host / loop:.0f}% of its time)", flush=True)
    for how in ("loop", "events"):
        ms_f, ms_b = ms[how]
        print(f"RESULT {name} fwd {B} {H} {T} {D} {ms_f:.4f} {flops / ms_f * 1e-9:.1f} {how}", flush=True)
        print(f"RESULT {name} bwd {B} {H} {T} {D} {ms_b:.4f} {2.5 * flops / ms_b * 1e-9:.1f} {how}", flush=True)


def main():
    shapes = [tuple(int(x) for x in a.split(":")) for a in sys.argv[1:]] or SHAPES
    print(f"info torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    for B, H, T, D in shapes:
        bench(SDPBackend.FLASH_ATTENTION, "torch-flash", B, H, T, D)
        bench(SDPBackend.CUDNN_ATTENTION, "torch-cudnn", B, H, T, D)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
