"""PyTorch reference for checking gradsync's models exactly: builds a preset from models.py,
loads its initial state from --init (safetensors), trains on the one batch in --batch
(`x`: float32 [N, C, H, W], `y`: int64/int32 labels [N]) with softmax cross-entropy (mean) and
torch.optim.SGD(lr, momentum, weight_decay), in train mode (BatchNorm uses batch statistics and
updates its running buffers), and writes to --out (safetensors, all float32):
  loss0        [1]       loss of the first step (before any update)
  logits       [N, K]    logits of the first step
  grad.<name>            gradient of every parameter at the first step
  losses       [steps]   loss of each step, computed before that step's update
  <name>                 every state-dict entry after the steps (parameters, running_mean,
                         running_var; num_batches_tracked as float32)
and prints one JSON object: {"model", "params", "loss0", "final_loss"} (final_loss = losses[-1]).

--init needs every parameter; running buffers and num_batches_tracked absent from it keep the
module's defaults (zeros, ones, 0). With --describe, prints the parameter and buffer names and
shapes instead: {"params": [[name, shape], ...], "buffers": [...], "param_count": N}."""
import argparse, json, os, sys

# Deterministic cuBLAS needs this before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.nn.functional as F

import models


def fail(msg):
    print(f"reference.py: {msg}", file=sys.stderr)
    sys.exit(2)


def load_init(model, path):
    """Load `path` into `model` with load_state_dict(strict=True); buffers missing from the file
    keep the module's values; missing parameters or unknown names are an error."""
    from safetensors.torch import load_file

    given = load_file(path)
    own = model.state_dict()
    param_names = {n for n, _ in model.named_parameters()}
    missing = [n for n in own if n not in given and n in param_names]
    if missing:
        fail(f"{path}: missing parameters: {', '.join(missing)}")
    unexpected = [n for n in given if n not in own]
    if unexpected:
        fail(f"{path}: unknown names: {', '.join(unexpected)}")
    state = {}
    for name, ref in own.items():
        if name not in given:
            state[name] = ref.clone()  # a buffer the file does not carry
            continue
        t = given[name]
        if t.numel() != ref.numel() or (ref.dim() > 0 and tuple(t.shape) != tuple(ref.shape)):
            fail(f"{path}: {name} has shape {list(t.shape)}, want {list(ref.shape)}")
        if ref.dim() == 0:
            t = t.reshape(())  # num_batches_tracked may be stored as [1]
        state[name] = t.to(ref.dtype)
    model.load_state_dict(state, strict=True)


def f32(t):
    return t.detach().to("cpu", torch.float32).contiguous().clone()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="resnet20, resnet18, vgg11, cnn8 or mlp:W-W-...")
    p.add_argument("--in-channels", type=int, required=True)
    p.add_argument("--height", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--describe", action="store_true", help="print names and shapes, then exit")
    p.add_argument("--init", help="initial state dict, safetensors")
    p.add_argument("--batch", help="safetensors with x [N, C, H, W] float32 and y [N] labels")
    p.add_argument("--out", help="safetensors to write")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--plain-conv", action="store_true",
                   help="PyTorch's own im2col-and-GEMM convolutions: cuDNN off on a GPU, oneDNN off on the CPU")
    p.add_argument("--float64", action="store_true",
                   help="compute in float64 (the outputs are still written as float32): the trajectory "
                        "that float32 arithmetic rounds away from")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    try:
        model = models.build(a.model, a.in_channels, a.height, a.width, a.classes)
    except ValueError as e:
        fail(str(e))

    if a.describe:
        params, buffers = models.describe(model)
        print(json.dumps({"params": params, "buffers": buffers, "param_count": models.param_count(model)}))
        return

    for flag in ("init", "batch", "out"):
        if getattr(a, flag) is None:
            fail(f"--{flag} is required (unless --describe)")
    if a.steps < 1:
        fail("--steps must be at least 1")

    dev = torch.device(a.device)
    if a.plain_conv:
        torch.backends.cudnn.enabled = False
        torch.backends.mkldnn.enabled = False
    if dev.type == "cuda":
        # Exact float32 arithmetic and deterministic kernels; some CUDA kernels have no
        # deterministic version, so only warn there.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)

    load_init(model, a.init)
    from safetensors.torch import load_file, save_file

    batch = load_file(a.batch)
    for k in ("x", "y"):
        if k not in batch:
            fail(f"{a.batch}: no tensor {k!r}")
    dtype = torch.float64 if a.float64 else torch.float32
    x = batch["x"].to(dtype)
    y = batch["y"].to(torch.int64)
    if x.dim() == 2 and x.shape[1] == a.in_channels * a.height * a.width:
        x = x.reshape(-1, a.in_channels, a.height, a.width)
    if tuple(x.shape[1:]) != (a.in_channels, a.height, a.width) or y.shape != (x.shape[0],):
        fail(f"{a.batch}: x {list(x.shape)}, y {list(y.shape)}; want x [N, {a.in_channels}, "
             f"{a.height}, {a.width}], y [N]")
    model.to(dev, dtype).train()
    x, y = x.to(dev), y.to(dev)

    # An embedding table steps lazily (only rows with a gradient, their momentum too), the rest
    # with PyTorch's SGD.
    table = getattr(model, "embedding", None)
    dense = [prm for prm in model.parameters() if table is None or prm is not table.weight]
    opt = torch.optim.SGD(dense, lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay)
    table_momentum = None if table is None else torch.zeros_like(table.weight)
    out = {}
    losses = []
    for step in range(a.steps):
        opt.zero_grad()
        if table is not None:
            table.weight.grad = None
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        losses.append(loss.detach())
        if step == 0:
            out["loss0"] = f32(loss).reshape(1)
            out["logits"] = f32(logits)
            for name, prm in model.named_parameters():
                out[f"grad.{name}"] = f32(prm.grad)
        opt.step()
        if table is not None:
            models.lazy_rows_step(table.weight, table.weight.grad, table_momentum, a.lr, a.momentum,
                                  a.weight_decay)
    out["losses"] = f32(torch.stack(losses))
    for name, t in model.state_dict().items():
        out[name] = f32(t)
    save_file(out, a.out)
    print(json.dumps({"model": a.model, "params": models.param_count(model),
                      "loss0": float(out["loss0"][0]), "final_loss": float(out["losses"][-1])}))


if __name__ == "__main__":
    main()
