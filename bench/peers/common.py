"""What the three training programs share: key=value parsing, the device and process group,
the random batches, and the measurement (the clock and the peak memory)."""
import contextlib
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


def fail(prog, msg):
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_keys(prog, defaults, argv, choices=None):
    """key=value arguments over defaults, each value of its default's type; choices maps a
    key to its allowed values. An unknown key or a bad value exits with status 2."""
    cfg, choices = dict(defaults), choices or {}
    for a in argv:
        if a in ("-h", "--help", "help"):
            print(f"usage: {prog} " + " ".join(f"{k}={v}" for k, v in defaults.items()))
            sys.exit(0)
        k, sep, v = a.partition("=")
        if not sep:
            fail(prog, f"{a}: arguments are key=value")
        if k not in defaults:
            fail(prog, f"{k}: unknown key (known: {', '.join(defaults)})")
        try:
            cfg[k] = type(defaults[k])(v)
        except ValueError:
            fail(prog, f"{k}={v}: must be {'an integer' if isinstance(defaults[k], int) else 'a number'}")
        if k in choices and cfg[k] not in choices[k]:
            fail(prog, f"{k}={v}: must be one of {', '.join(map(str, choices[k]))}")
    return cfg


def check(prog, ok, msg):
    if not ok:
        fail(prog, msg)


def positive(prog, cfg, *keys, zero=()):
    for k in keys:
        check(prog, cfg[k] >= (0 if k in zero else 1), f"{k}={cfg[k]}: must be {'>= 0' if k in zero else '>= 1'}")


class Env:
    """The device and, under torchrun (LOCAL_RANK set), the process group: NCCL on GPUs,
    gloo on the CPU."""

    def __init__(self, prog, device):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            fail(prog, "device=cuda: no GPU found (device=cpu runs on the CPU)")
        self.distributed = "LOCAL_RANK" in os.environ
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "cuda":
            torch.cuda.set_device(self.local)
            self.dev = torch.device("cuda", self.local)
        else:
            self.dev = torch.device("cpu")
        if self.distributed:
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 1
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gb(self):
        """GPU: the allocator's high-water mark since reset_peak; CPU: the process's max RSS
        (which cannot be reset, so it includes the start)."""
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 1e9
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9

    def close(self):
        if self.distributed:
            dist.destroy_process_group()


@contextlib.contextmanager
def default_dtype(dtype):
    """Builds modules in dtype: their initial values are then drawn in that dtype, as the
    reference does, rather than drawn in fp32 and rounded."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Batches:
    """Random tokens [B, T+1] from a CPU generator seeded 1234 + seed_rank: the reference's
    data, drawn with the same calls, so that step 1 sees the same tokens. draws > 1 makes
    each batch the concatenation of the batches of `draws` consecutive seed ranks (one
    process then trains on what that many data-parallel ranks see together)."""

    def __init__(self, V, B, T, seed_rank, dev, draws=1):
        self.gens = [torch.Generator(device="cpu").manual_seed(1234 + seed_rank + i) for i in range(draws)]
        self.V, self.B, self.T, self.dev = V, B, T, dev

    def next(self):
        parts = [torch.randint(0, self.V, (self.B, self.T + 1), generator=g) for g in self.gens]
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)
        return batch.to(self.dev, non_blocking=True)


def clock():
    return time.perf_counter()
