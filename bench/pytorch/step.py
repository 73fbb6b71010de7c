"""PyTorch eager reference for `gradsync-bench step`: the same model (an MLP from --widths, or a
preset of models.py from --model with its input shape), softmax cross-entropy, SGD with momentum
and weight decay, timed the same way, in FP32 (TF32 off for matrix products and convolutions,
which cuDNN would otherwise use on Ampere and later).

One process serves every configuration of a run, so torch is imported and CUDA started once:
the command line names the device and threads, and each line on stdin is one configuration,
its model and timing flags as a JSON list of arguments (["--model", "resnet18", "--batch",
"64"]); each is answered with one line of JSON on stdout: the figures, the torch version and
whether TF32 was allowed."""
import argparse, json, statistics, sys, time

import torch


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--widths", default="784-1024-1024-10")
    p.add_argument("--model", help="a preset of models.py (resnet20, resnet18, vgg11, cnn8); overrides --widths")
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    return p


def time_step(a, dev):
    if a.model:
        import models

        model = models.build(a.model, a.in_channels, a.height, a.width, a.classes).to(dev)
        x = torch.randn(a.batch, a.in_channels, a.height, a.width, device=dev)
        classes = a.classes
    else:
        w = [int(x) for x in a.widths.split("-")]
        layers = []
        for i in range(len(w) - 1):
            layers.append(torch.nn.Linear(w[i], w[i + 1]))
            if i < len(w) - 2:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers).to(dev)
        x = torch.randn(a.batch, w[0], device=dev)
        classes = w[-1]
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    y = torch.randint(0, classes, (a.batch,), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    f, b, u, t = [], [], [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        sync()
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        if i >= a.warmup:
            f.append((t1 - t0) * 1e3)
            b.append((t2 - t1) * 1e3)
            u.append((t3 - t2) * 1e3)
            t.append((t3 - t0) * 1e3)
    med = statistics.median
    return {"step_ms": med(t), "forward_ms": med(f), "backward_ms": med(b), "update_ms": med(u),
            "torch": torch.__version__,
            "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}}


def main():
    base = parser().parse_args()
    if base.threads > 0:
        torch.set_num_threads(base.threads)
    # FP32 as gradsync computes it: no TF32 in cuBLAS's matrix products or cuDNN's convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(base.device)
    for line in sys.stdin:
        if not line.strip():
            continue
        a = parser().parse_args(["--device", base.device, "--threads", str(base.threads)] + json.loads(line))
        figures = time_step(a, dev)
        print(json.dumps(figures), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
