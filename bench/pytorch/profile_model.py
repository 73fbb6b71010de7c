"""Measure a PyTorch model's gradient profile for gradsync to replay (docs/replay.md).

    python bench/pytorch/profile_model.py torchvision.models.resnet50 --batch 64 \
        --input 3x224x224 --device cuda --out resnet50.json
    python bench/pytorch/profile_model.py my_model.py:build --input tokens:128:30522 --out my.json
    gradsync-worker train --mode ddp --model profile:resnet50.json ...

MODEL is an import path to an nn.Module class or a function returning one
(`package.module.name`), or `FILE.py:NAME`; `--kwargs` passes it keyword arguments as JSON.

What it writes (format "gradsync-profile", version 1):
- each parameter tensor's name and shape, in the order backward makes its gradient ready
  (post-accumulate-grad hooks; a tied weight once, when its last contribution is in);
- the layers in backward order: each module that owns parameters, whose backward_ms is the
  time from the previous layer's gradients being ready to its own (so every gradient is
  handed to the communication at the moment it was ready here), and a final "(backward tail)"
  for what runs after the last gradient; forward_ms each such module's own forward time, and
  "(forward, other)" for the rest of forward (modules without parameters, functional ops);
- the optimiser step (SGD with momentum) as optimizer_ms.
Every time is the median over --steps measured steps after --warmup, with the device
synchronised at each hook, so a time is the work of what it names.
"""

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time

import torch


def load_model(spec, kwargs):
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path, name = spec.split(":", 1)
        mod_spec = importlib.util.spec_from_file_location("profiled_module", path)
        if mod_spec is None:
            raise SystemExit(f"profile_model.py: cannot load {path}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        if "." not in spec:
            raise SystemExit(f"profile_model.py: MODEL '{spec}' is neither package.module.name nor FILE.py:NAME")
        path, name = spec.rsplit(".", 1)
        module = importlib.import_module(path)
    if not hasattr(module, name):
        raise SystemExit(f"profile_model.py: {spec}: no '{name}' there")
    model = getattr(module, name)(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"profile_model.py: {spec} gave a {type(model).__name__}, not an nn.Module")
    return model


def make_input(text, batch, device):
    if text.startswith("tokens:"):
        parts = text.split(":")
        if len(parts) != 3:
            raise SystemExit(f"profile_model.py: --input '{text}' (expected tokens:LENGTH:VOCAB)")
        length, vocab = int(parts[1]), int(parts[2])
        return torch.randint(0, vocab, (batch, length), device=device)
    try:
        shape = [int(v) for v in text.split("x")]
    except ValueError:
        raise SystemExit(f"profile_model.py: --input '{text}' (expected CxHxW, N or tokens:LENGTH:VOCAB)")
    return torch.randn(batch, *shape, device=device)


def first_tensor(out):
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict) or hasattr(out, "values"):
        out = list(out.values())
    for v in out:
        t = first_tensor(v) if not torch.is_tensor(v) else v
        if t is not None and t.is_floating_point():
            return t
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--kwargs", default="{}", help="keyword arguments for MODEL, as JSON")
    ap.add_argument("--name", help="the profile's model name (default: MODEL's last part)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input", default="3x224x224", help="one sample: CxHxW, N, or tokens:LENGTH:VOCAB")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="autocast dtype for forward and backward (parameters and gradients stay float32)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.batch < 1 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("profile_model.py: --batch and --steps must be at least 1, --warmup at least 0")

    device = torch.device(a.device)
    torch.manual_seed(0)
    model = load_model(a.model, json.loads(a.kwargs)).to(device).train()
    x = make_input(a.input, a.batch, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    named = list(model.named_parameters())
    if not named:
        raise SystemExit(f"profile_model.py: {a.model} has no parameters")
    owner = {}
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            owner.setdefault(id(p), mname or "(root)")
    name_of = {id(p): n for n, p in named}

    # Hooks: each parameter's gradient-ready moment, each owning module's forward time.
    clock = {"t0": 0.0, "ready": {}, "fwd": {}, "starts": {}}

    def ready_hook(p):
        sync()
        clock["ready"][id(p)] = time.perf_counter() - clock["t0"]

    for _, p in named:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(ready_hook)
    owners = {owner[id(p)] for _, p in named}
    for mname, m in model.named_modules():
        if (mname or "(root)") in owners:
            def pre(mod, inp, key=mname or "(root)"):
                sync()
                clock["starts"][key] = time.perf_counter()

            def post(mod, inp, out, key=mname or "(root)"):
                sync()
                clock["fwd"][key] = clock["fwd"].get(key, 0.0) + time.perf_counter() - clock["starts"][key]

            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)

    autocast = a.dtype != "float32"
    runs = []
    for step in range(a.warmup + a.steps):
        clock["ready"], clock["fwd"] = {}, {}
        opt.zero_grad(set_to_none=True)
        sync()
        t = time.perf_counter()
        with torch.autocast(device.type, dtype=getattr(torch, a.dtype), enabled=autocast):
            out = first_tensor(model(x))
            if out is None:
                raise SystemExit(f"profile_model.py: {a.model}'s output holds no floating-point tensor")
            loss = out.float().pow(2).mean()
        sync()
        forward = time.perf_counter() - t
        clock["t0"] = time.perf_counter()
        loss.backward()
        sync()
        backward = time.perf_counter() - clock["t0"]
        t = time.perf_counter()
        opt.step()
        sync()
        optimizer = time.perf_counter() - t
        if step >= a.warmup:
            runs.append((forward, backward, optimizer, dict(clock["ready"]), dict(clock["fwd"])))

    # The order of the median-by-backward run (each run's order is the same for a given model).
    med = statistics.median
    ref = sorted(runs, key=lambda r: r[1])[len(runs) // 2]
    never = [name_of[id(p)] for _, p in named if id(p) not in ref[3]]
    order = sorted((t, i) for i, t in ref[3].items())
    layers, last_end, group = [], 0.0, None
    shapes = {n: list(p.shape) for n, p in named}
    for _, pid in order:
        key = owner[pid]
        if group is None or group["key"] != key:
            group = {"key": key, "ids": []}
            layers.append(group)
        group["ids"].append(pid)
    out_layers, timed = [], set()
    for g in layers:
        end = med([r[3][g["ids"][-1]] for r in runs])
        # A module whose tensors are ready in two runs of the order counts its forward once.
        first = g["key"] not in timed
        timed.add(g["key"])
        out_layers.append({
            "name": g["key"],
            "forward_ms": 1e3 * med([r[4].get(g["key"], 0.0) for r in runs]) if first else 0.0,
            "backward_ms": 1e3 * max(0.0, end - last_end),
            "tensors": [{"name": name_of[pid], "shape": shapes[name_of[pid]]} for pid in g["ids"]],
        })
        last_end = max(last_end, end)
    forward_ms, backward_ms = 1e3 * med([r[0] for r in runs]), 1e3 * med([r[1] for r in runs])
    tail = {"name": "(backward tail)", "forward_ms": 0.0, "backward_ms": max(0.0, backward_ms - 1e3 * last_end),
            "tensors": [{"name": n, "shape": shapes[n]} for n in never]}
    # A module that owns tensors and holds another that does times its child twice: the layers'
    # forward times are scaled so that together they never exceed the measured forward.
    owned = sum(l["forward_ms"] for l in out_layers)
    if owned > forward_ms > 0:
        for l in out_layers:
            l["forward_ms"] *= forward_ms / owned
    other = max(0.0, forward_ms - sum(l["forward_ms"] for l in out_layers))
    out_layers.append(tail)
    out_layers.append({"name": "(forward, other)", "forward_ms": other, "backward_ms": 0.0, "tensors": []})

    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = f"CPU, {torch.get_num_threads()} threads"
    note = (f"measured by profile_model.py: torch {torch.__version__}, {a.dtype}, input {a.input}, "
            f"median of {a.steps} steps after {a.warmup}; step {forward_ms:.3f} ms forward, "
            f"{backward_ms:.3f} ms backward")
    if never:
        note += f"; {len(never)} tensors got no gradient and are handed out at the end of backward"
    profile = {
        "format": "gradsync-profile",
        "version": 1,
        "model": a.name or a.model.replace(":", ".").split(".")[-1],
        "batch": a.batch,
        "device": dev,
        "estimated": False,
        "layers": out_layers,
        "optimizer_ms": 1e3 * med([r[2] for r in runs]),
        "note": note,
    }
    with open(a.out, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    params = sum(p.numel() for _, p in named)
    print(f"profile_model.py: {profile['model']}: {params} parameters in {len(named)} tensors, "
          f"{len(out_layers) - 2} layers with parameters; {note}; written to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
