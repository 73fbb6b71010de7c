"""PyTorch definitions of gradsync's model presets (resnet20, resnet18, vgg11, cnn8, mlp:W-W-...),
named as torchvision names them, so that state-dict names and shapes match gradsync's one for one.
Used by reference.py; `python models.py` runs a self-check of the parameter counts and prints
one JSON object.

Conventions shared by every preset:
  * every conv is 3x3 with padding 1 unless said otherwise; no dropout anywhere;
  * BatchNorm2d with eps=1e-5, momentum=0.1, affine, running stats tracked;
  * global average pooling is a plain mean over H and W (x.mean((2, 3))), not AdaptiveAvgPool2d;
  * flattening is PyTorch's NCHW order (index c*H*W + h*W + w).
"""
import json

import torch
from torch import nn

BN_EPS = 1e-5
BN_MOMENTUM = 0.1

# torchvision's vgg11_bn configuration ("A").
VGG11_CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def conv3x3(cin, cout, stride=1, bias=False):
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=bias)


def bn(c):
    return nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM, affine=True, track_running_stats=True)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv1-bn1-relu-conv2-bn2, plus the shortcut, then relu.
    The shortcut is the identity, or `downsample` (1x1 conv with the block's stride, then BN)
    when the stride is not 1 or the channel count changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = bn(cout)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(cout, cout, 1)
        self.bn2 = bn(cout)
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False), bn(cout))
        else:
            self.downsample = None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + identity
        return self.relu(out)


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stride-1 stem (no max-pool), stages of BasicBlocks whose first
    block (from the second stage on) has stride 2, global average pool, `fc`."""

    def __init__(self, in_channels, widths, blocks, classes, stem):
        super().__init__()
        self.conv1 = conv3x3(in_channels, stem, 1)
        self.bn1 = bn(stem)
        self.relu = nn.ReLU()
        cin = stem
        for i, (w, n) in enumerate(zip(widths, blocks)):
            layer = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layer.append(BasicBlock(cin, w, stride))
                cin = w
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.num_layers = len(widths)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(self.num_layers):
            x = getattr(self, f"layer{i + 1}")(x)
        x = x.mean(dim=(2, 3))  # global average pool -> [N, C]
        return self.fc(x)


class FeaturesClassifier(nn.Module):
    """`features` (convolutional Sequential), NCHW flatten, `classifier` (Sequential)."""

    def __init__(self, features, classifier):
        super().__init__()
        self.features = features
        self.classifier = classifier

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg11(in_channels, height, width, classes):
    """vgg11_bn's features, except that a max-pool whose input is smaller than 2x2 is an
    nn.Identity at the same index; classifier sized for the final feature map, no dropout."""
    layers = []
    c, h, w = in_channels, height, width
    for v in VGG11_CFG:
        if v == "M":
            if h < 2 or w < 2:
                layers.append(nn.Identity())
            else:
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                h, w = h // 2, w // 2
        else:
            layers += [conv3x3(c, v, 1, bias=True), bn(v), nn.ReLU()]
            c = v
    flat = c * h * w
    classifier = nn.Sequential(
        nn.Linear(flat, 4096), nn.ReLU(),
        nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, classes))
    return FeaturesClassifier(nn.Sequential(*layers), classifier)


def cnn8(in_channels, height, width, classes):
    features = nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1, bias=False), bn(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), bn(64), nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2))
    classifier = nn.Sequential(
        nn.Linear(64 * (height // 2) * (width // 2), 128), nn.ReLU(),
        nn.Linear(128, classes))
    return FeaturesClassifier(features, classifier)


class MLP(nn.Sequential):
    """Linear, ReLU, ..., Linear; flattens its input to [N, -1] first (adds no state)."""

    def forward(self, x):
        return super().forward(torch.flatten(x, 1))


def mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return MLP(*layers)


class EmbeddingNet(nn.Module):
    """gradsync's sparse model: an embedding bag then linear layers with ReLUs between them.
    A sample is [ids..., weights...] of `slots` each (an id below 0 is an empty slot); the bag
    is the weighted sum of its ids' rows, or under mean pooling that sum over the number of ids
    (nn.EmbeddingBag takes per-sample weights in sum mode only, so the mean is passed as the
    weights divided by the count)."""

    def __init__(self, rows, dim, hidden, classes, mean):
        super().__init__()
        self.embedding = nn.EmbeddingBag(rows, dim, mode="sum")
        widths = [dim] + hidden + [classes]
        layers = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)
        self.mean = mean

    def forward(self, x):
        x = x.reshape(x.shape[0], -1)
        slots = x.shape[1] // 2
        ids, w = x[:, :slots], x[:, slots:]
        keep = ids >= 0
        counts = keep.sum(1)
        if self.mean:
            w = w / counts.clamp(min=1).unsqueeze(1).to(w.dtype)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
        pooled = self.embedding(ids[keep].long(), offsets, per_sample_weights=w[keep])
        return self.mlp(pooled)


def embedding(name, classes):
    """`embedding:ROWS:DIM[:HIDDEN...]:POOL` (gradsync's token, without the data's part)."""
    parts = name.split(":")[1:]
    if len(parts) < 3 or parts[-1] not in ("sum", "mean"):
        raise ValueError(f"{name}: expected embedding:ROWS:DIM[:HIDDEN...]:sum|mean")
    rows, dim, hidden = int(parts[0]), int(parts[1]), [int(h) for h in parts[2:-1]]
    return EmbeddingNet(rows, dim, hidden, classes, parts[-1] == "mean")


def lazy_rows_step(table, grad, momentum_buf, lr, momentum, weight_decay):
    """SGD with momentum on the rows of `table` whose gradient is not all zero; the other rows,
    and their momentum, stay as they are (gradsync's lazy momentum for an embedding table)."""
    with torch.no_grad():
        rows = grad.ne(0).any(1).nonzero().flatten()
        g = grad[rows] + weight_decay * table[rows]
        m = momentum * momentum_buf[rows] + g
        momentum_buf[rows] = m
        table[rows] = table[rows] - lr * m


def build(name, in_channels, height, width, classes):
    """The preset `name` for [N, in_channels, height, width] inputs and `classes` outputs."""
    if name == "resnet20":
        return ResNet(in_channels, [16, 32, 64], [3, 3, 3], classes, stem=16)
    if name == "resnet18":
        return ResNet(in_channels, [64, 128, 256, 512], [2, 2, 2, 2], classes, stem=64)
    if name == "vgg11":
        return vgg11(in_channels, height, width, classes)
    if name == "cnn8":
        return cnn8(in_channels, height, width, classes)
    if name.startswith("mlp:"):
        widths = [int(v) for v in name[4:].split("-")]
        if len(widths) < 2:
            raise ValueError(f"{name}: an MLP needs at least an input and an output width")
        if widths[0] != in_channels * height * width:
            raise ValueError(f"{name}: input width {widths[0]} != {in_channels}*{height}*{width}")
        if widths[-1] != classes:
            raise ValueError(f"{name}: output width {widths[-1]} != classes {classes}")
        return mlp(widths)
    if name.startswith("embedding:"):
        return embedding(name, classes)
    raise ValueError(f"unknown model {name!r} (resnet20, resnet18, vgg11, cnn8, mlp:W-W-..., embedding:...)")


def describe(model):
    """([(name, shape)] of parameters in named_parameters() order,
        [(name, shape)] of buffers (running_mean, running_var, num_batches_tracked))."""
    params = [(n, list(p.shape)) for n, p in model.named_parameters()]
    buffers = [(n, list(b.shape)) for n, b in model.named_buffers()]
    return params, buffers


def param_count(model):
    return sum(p.numel() for p in model.parameters())


def self_check():
    expect = {("resnet18", 3, 32, 32, 10): 11_173_962, ("vgg11", 3, 32, 32, 10): 28_149_514}
    out = {}
    for name in ["resnet20", "resnet18", "vgg11", "cnn8"]:
        for c, h, w in [(3, 32, 32), (1, 8, 8)]:
            m = build(name, c, h, w, 10)
            n = param_count(m)
            want = expect.get((name, c, h, w, 10))
            assert want is None or n == want, f"{name} {c}x{h}x{w}: {n} parameters, want {want}"
            y = m(torch.randn(2, c, h, w))
            assert tuple(y.shape) == (2, 10), f"{name} {c}x{h}x{w}: logits {tuple(y.shape)}"
            out[f"{name}@{c}x{h}x{w}"] = {"params": n, "tensors": len(list(m.parameters()))}
    print(json.dumps(out))


if __name__ == "__main__":
    self_check()
