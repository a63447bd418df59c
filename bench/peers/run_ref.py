"""Runs a reference program (torch_llama.py, torch_llama_tp.py or torch_llama_pp.py, as kept
beside the project in ../shared/peers) as it is, and adds the loss of its first step to the
JSON line it prints, as "loss_step1", so that a benchmark can hold bench/peers/train.py's step
1 against it. The reference prints only its last step's loss; step 1 is the one that depends
on nothing but the initialisation, the data and the forward pass.

Usage: python3 bench/peers/run_ref.py PATH/torch_llama.py key=value ... [device=cpu]
       torchrun --nproc_per_node=2 bench/peers/run_ref.py PATH/torch_llama.py key=value ...

The loss is read where the reference calls loss.backward() on it (one process, DDP, FSDP,
tensor parallel). The pipeline reference's schedule runs the backward itself, so there
"loss_step1" is left out.

device=cpu (the default where no GPU is found) runs the reference on the CPU, so that the
programs can be checked against each other on a machine without a GPU: the reference's source
is loaded with its device strings changed ("cuda" -> "cpu", "nccl" -> "gloo", .cuda() ->
.cpu()), FSDP given the CPU as its device, torch.cuda's set_device, synchronize and peak-memory calls stubbed (the peak becomes
the process's max RSS, as bench/peers/train.py reports on a CPU), and fp32 throughout (its
bf16 default dtype and its autocast turned off), which is what bench/peers/train.py does on a
CPU; fp32=0 keeps the reference's dtypes instead (pure bf16, or bf16 autocast with amp=1),
as fp32=0 does for bench/peers/train.py. Each change is listed on stderr. On a GPU nothing is
changed.
"""
import contextlib, gc, importlib.util, io, json, os, resource, sys, types

import torch

# (old, new): applied where present; at least one device string must change
CPU_EDITS = [
    ('"cuda"', '"cpu"'), ('"nccl"', '"gloo"'), (".cuda()", ".cpu()"),
    # FSDP finds its device from the parameters, and refuses the CPU unless told
    ("use_orig_params=True)", 'use_orig_params=True, device_id=torch.device("cpu"))'),
]
FP32_EDITS = [
    ("torch.set_default_dtype(torch.bfloat16)", "torch.set_default_dtype(torch.float32)"),
    ('enabled=bool(cfg["amp"])', "enabled=False"),
]


def load_for_cpu(path, name, fp32):
    src = open(path).read()
    done = []
    for old, new in CPU_EDITS + (FP32_EDITS if fp32 else []):
        n = src.count(old)
        if n:
            src = src.replace(old, new)
            done.append(f"{n} x {old} -> {new}")
    if not any('"cpu"' in d or ".cpu()" in d for d in done):
        sys.exit(f"run_ref: {path}: no device string to change; is it one of the reference programs?")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run_ref: {os.path.basename(path)} on CPU: " + "; ".join(done), file=sys.stderr)
    rss = lambda *a, **k: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for fn in ("set_device", "synchronize", "reset_peak_memory_stats"):
        setattr(torch.cuda, fn, lambda *a, **k: None)
    torch.cuda.max_memory_allocated = rss
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        sys.exit("usage: run_ref.py PATH/torch_llama.py key=value ... [device=cpu|cuda]")
    path, keys = os.path.abspath(sys.argv[1]), sys.argv[2:]
    if not os.path.isfile(path):
        sys.exit(f"run_ref: {path}: no such file (pass the folder holding the reference programs)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp32, rest = "1", []
    for k in keys:
        if k.startswith("device="):
            device = k.split("=", 1)[1]
        elif k.startswith("fp32="):
            fp32 = k.split("=", 1)[1]
        else:
            rest.append(k)
    if device not in ("cpu", "cuda"):
        sys.exit(f"run_ref: device={device}: must be cpu or cuda")
    sys.path.insert(0, os.path.dirname(path))  # the tp and pp references import torch_llama
    name = os.path.splitext(os.path.basename(path))[0]
    mod = load_for_cpu(path, name, fp32 != "0") if device == "cpu" else load(path, name)

    first = []
    backward = torch.Tensor.backward

    def recording_backward(self, *a, **k):
        if not first:
            first.append(float(self.detach().float()))
        return backward(self, *a, **k)

    torch.Tensor.backward = recording_backward
    sys.argv = [path] + rest
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            mod.main()
    finally:
        # The reference keeps its model and optimizer in module globals; dropped here, the
        # DDP reducer goes before the interpreter's exit rather than during it, where gloo
        # on a CPU can abort ("terminate called without an active exception").
        for k, v in list(vars(mod).items()):
            if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
                delattr(mod, k)
        gc.collect()
        lines = out.getvalue().splitlines()
        last = max((i for i, l in enumerate(lines) if l.startswith("{")), default=None)
        for i, line in enumerate(lines):
            if i == last and first:
                d = json.loads(line)
                d["loss_step1"] = first[0]
                line = json.dumps(d)
            print(line, flush=True)


if __name__ == "__main__":
    main()
