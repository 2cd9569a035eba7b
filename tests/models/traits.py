"""Small models each built around one trait HCModule must handle: weights tied or frozen or
reused, a model that checkpoints itself, no_grad and autocast regions inside the forward,
random ops, data-dependent or shape-dependent Python control flow, buffers and Python
attributes updated in forward, keyword flags, list/dict inputs and container outputs."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from models.toy import D, MLPBlock, MLPNet
from torch import nn
from torch.utils.checkpoint import checkpoint


class TiedFrozenLM(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)

    def forward(self, idx, targets):
        h = self.body(self.emb(idx))
        h = h + self.frozen(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten()), h


class TiedAcross(nn.Module):
    """One Linear module reused at layers 1 and 4, and a weight shared by layers 0 and 5."""

    def __init__(self, dim=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(6))
        self.layers[4] = self.layers[1]
        self.layers[5].weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class SharedBlock(nn.Module):
    """One block called three times (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.mid = nn.Linear(64, 64)

    def forward(self, x):
        h = self.mid(self.block(x)).relu()
        h = self.block(h) + h
        return self.block(h)


class FrozenBackbone(nn.Module):
    """A pretrained-style frozen feature extractor (requires_grad False) + trainable head."""

    def __init__(self, dim=64, depth=6, classes=5):
        super().__init__()
        self.backbone = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.GELU())
                for _ in range(depth)
            ]
        )
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(
            nn.Linear(dim, 2 * dim),
            nn.GELU(),
            nn.Linear(2 * dim, 2 * dim),
            nn.GELU(),
            nn.Linear(2 * dim, classes),
        )

    def forward(self, x):
        return self.head(self.backbone(x))


class SelfCheckpointed(nn.Module):
    """A model that already checkpoints its own blocks with torch.utils.checkpoint."""

    def __init__(self, dim=64, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim)
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class Distill(nn.Module):
    """A frozen teacher run under `torch.no_grad()` and a student body under bfloat16
    autocast, both inside the forward (fx records ops, not context managers)."""

    def __init__(self, dim=64):
        super().__init__()
        self.teacher = MLPNet(dim, 3)
        self.body = MLPNet(dim, 4)
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.body(x)
        out = self.head(h.float())
        return F.mse_loss(out, target), h.dtype


class RandomOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)])

    def forward(self, x):
        for layer in self.layers:
            x = F.dropout(F.gelu(layer(x)), 0.2, self.training)
        x = x * torch.rand_like(x).gt(0.1)
        return x + 0.01 * torch.randn(x.shape)


class DataDependentMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.Sequential(*[MLPBlock() for _ in range(6)])

    def forward(self, x):
        h = self.pre(x)
        if h.mean() > 100:  # data-dependent control flow: op-level capture fails
            h = h.flip(0)
        return self.blocks(h)


class DataDependentNet(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.body = MLPNet(dim, 4).layers  # an nn.Sequential: its children are cut points

    def forward(self, x):
        h = self.pre(x)
        if h.sum() > 0:  # data-dependent control flow
            h = -h
        return self.body(h)


class HostRandomLayerDrop(nn.Module):
    """Skips each layer with probability 1/2 drawn from Python's `random` (`numpy=True`: from
    numpy's global generator), as research code's LayerDrop can."""

    def __init__(self, numpy: bool = False, depth: int = 6):
        super().__init__()
        self.numpy = numpy
        self.pre = nn.Linear(D, D)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(depth))

    def forward(self, x):
        import random

        import numpy as np

        h = self.pre(x)
        for layer in self.layers:
            draw = np.random.rand() if self.numpy else random.random()
            if self.training and draw < 0.5:
                continue
            h = layer(h)
        return h.square().mean()


class TorchRandLayerDrop(HostRandomLayerDrop):
    """transformers' LayerDrop: `torch.rand([])` and a Python `if` (op-level capture fails on
    the branch; the module-level plan sees the layers of the captured step only)."""

    def forward(self, x):
        h = self.pre(x)
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            h = layer(h)
        return h.square().mean()


class ReshapesInPlace(nn.Module):
    """An in-place view op (`unsqueeze_`) on an activation in each block, whose new shape a
    broadcast then reads (BigBird-Pegasus' block-sparse attention does this)."""

    def __init__(self, d=64, n=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        # a spread of its own width per block: what reads the new shape differs per block
        self.spreads = nn.ParameterList(torch.randn(1, i + 2, 1) for i in range(n))

    def forward(self, x):
        for layer, spread in zip(self.layers, self.spreads):
            g = layer(x) + 1.0
            g.unsqueeze_(1)  # (B, 1, D)
            x = x + (g * spread).sum(1)
        return x


class ReshapesInPlaceExported(ReshapesInPlace):
    """The same, with a forward that only the export tracer captures (`torch.is_tensor` on an
    argument, as transformers' forwards ask)."""

    def forward(self, x):
        if not torch.is_tensor(x):
            raise TypeError("x must be a tensor")
        return super().forward(x)


class LoggingBlock(nn.Module):
    def __init__(self, index: int, d: int):
        super().__init__()
        self.index = index
        self.linear = nn.Linear(d, d)

    def forward(self, x, log: list):
        assert len(log) == self.index, "a block runs after the ones before it, once"
        log.append(x)
        return torch.tanh(self.linear(x))


class SharedLogNet(nn.Module):
    """Blocks that append to one list passed down the forward (as transformers' key/value
    cache objects are), behind a data-dependent branch: no tracer captures it, and a block
    call recorded for the module-level fallback does not run again alone (the list then
    holds every block's entry)."""

    def __init__(self, d=32, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(LoggingBlock(i, d) for i in range(n))

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            x = -x
        log: list = []
        for block in self.blocks:
            x = block(x, log)
        return x


class DataDependentTail(nn.Module):
    """Blocks behind a data-dependent branch: no tracer captures it (module-level fallback)."""

    def __init__(self, d=64, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        if x.sum() > 0:
            x = x * 2
        return x


class ShapeBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.big, self.small = nn.Linear(64, 64), nn.Linear(64, 64)
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x):
        x = self.big(x).relu() if x.shape[0] > 100 else self.small(x).tanh()
        for _ in range(x.size(-1) // 32):
            x = x + self.body(x)
        return x


class RunningMean(nn.Module):
    """Keeps a running mean of its first layer's output in a buffer, in place."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(4)
        )
        self.register_buffer("running", torch.zeros(64))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def update(self, h):
        with torch.no_grad():
            self.running.mul_(0.9).add_(h.mean(0), alpha=0.1)
            self.count += 1  # rebinds the buffer (in place on a real tensor)

    def forward(self, x):
        h = self.layers[0](x)
        self.update(h)
        h = h - self.running
        for layer in self.layers[1:]:
            h = h + layer(h)
        return h


class ReassignedMean(RunningMean):
    """The same, out of place: the buffer is reassigned a new tensor."""

    def update(self, h):
        self.running = 0.9 * self.running + 0.1 * h.mean(0).detach()
        self.count = self.count + 1


class CountingCalls(RunningMean):
    """The same plus a Python counter: a side effect a traced graph would lose."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class KeywordFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            *[nn.Sequential(nn.Linear(128 if i else 64, 128), nn.Tanh()) for i in range(4)]
        )
        self.extra = nn.Linear(128, 128)

    def forward(self, x, *, scale=1.0, use_extra=False, mask=None):
        h = self.body(x) * scale
        if use_extra:
            h = self.extra(h).tanh()
        return h if mask is None else h * mask


class ListInput(nn.Module):
    """forward(xs: list of tensors) and forward(batch: dict of tensors)."""

    def __init__(self, dim=64, depth=4):
        super().__init__()
        self.a = MLPNet(dim, depth)
        self.b = MLPNet(dim, depth)

    def forward(self, xs):
        return self.a(xs[0]) * torch.sigmoid(self.b(xs[1]))


class DictInput(ListInput):
    def forward(self, batch):
        h = self.a(batch["x"]) + self.b(batch["y"])
        return {"h": h, "masked": h.masked_fill(~batch["keep"], 0.0)}


class DictWithAuxLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 64), nn.SiLU()) for _ in range(5)]
        )
        self.classifier = nn.Linear(64, 10)

    def forward(self, x, labels):
        h = self.encoder(x)
        logits = self.classifier(h)
        aux = 0.01 * h.pow(2).mean()
        return {"logits": logits, "loss": F.cross_entropy(logits, labels) + aux, "aux": aux}


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return [h, {"relu": h.relu(), "n": 3}], OrderedDict(a=h.sum()), x.shape[0]
