"""ResNet (He et al. 2016) with BatchNorm, as torchvision builds it: basic blocks for depth
10/18/34 (ResNet-10: one block per stage), bottleneck blocks for depth 50, base width `width` (64 is the standard network).

`model(images)` returns class logits [B, num_classes]; the loss is cross-entropy against
random labels. `blocks` is every residual block of every stage, in order; the stem (conv,
BatchNorm, ReLU, max-pool) and the head (average pool, linear) stay outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hbp.workloads import require
from hbp.workloads.base import Batch


@dataclass(frozen=True)
class ResNetConfig:
    """ResNet-`depth` with base width `width`, on batch_size x 3 x image_size x image_size
    images and `num_classes` classes."""

    depth: int = 18
    width: int = 16
    num_classes: int = 10
    image_size: int = 64
    batch_size: int = 32

    def validate(self) -> None:
        require(self.depth in STAGES, "depth", self.depth, "one of " + ", ".join(map(str, STAGES)))
        for name in ("width", "num_classes", "image_size", "batch_size"):
            value = getattr(self, name)
            require(value >= 1, name, value, "an integer >= 1")


PROFILES = {
    # Test-sized: a step in about a hundredth of a second.
    "tiny": ResNetConfig(depth=10, width=8, image_size=16, batch_size=4),
    # ~0.1 s per step on one CPU thread; activations ~5x the parameter gradients.
    "small": ResNetConfig(),
    # ResNet-18 (11.7M parameters) on 96 x 96 images; activations ~5x the parameter gradients.
    "medium": ResNetConfig(depth=18, width=64, num_classes=1000, image_size=96, batch_size=64),
    # ResNet-50 (25.6M parameters) on 128 x 128 images.
    "large": ResNetConfig(depth=50, width=64, num_classes=1000, image_size=128, batch_size=16),
}


def conv_bn(in_ch: int, out_ch: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Conv (no bias, 'same' padding) followed by BatchNorm."""
    conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """relu(x' + bn(conv3x3(relu(bn(conv3x3(x)))))) with x' = x or a strided 1x1 projection."""

    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn(in_ch, planes, 3, stride)
        self.conv2 = conv_bn(planes, planes, 3)
        out_ch = planes * self.expansion
        self.shortcut = (
            conv_bn(in_ch, out_ch, 1, stride) if stride != 1 or in_ch != out_ch else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.conv2(F.relu(self.conv1(x), inplace=True))
        return F.relu(out + identity, inplace=True)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (strided, as torchvision's ResNet v1.5) -> 1x1 expand by 4."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int):
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = conv_bn(in_ch, planes, 1)
        self.conv2 = conv_bn(planes, planes, 3, stride)
        self.conv3 = conv_bn(planes, out_ch, 1)
        self.shortcut = (
            conv_bn(in_ch, out_ch, 1, stride) if stride != 1 or in_ch != out_ch else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = F.relu(self.conv1(x), inplace=True)
        out = self.conv3(F.relu(self.conv2(out), inplace=True))
        return F.relu(out + identity, inplace=True)


STAGES = {
    10: (BasicBlock, (1, 1, 1, 1)),
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
}


class ResNet(nn.Module):
    """Stem -> `blocks` (4 stages, widths width x 1, 2, 4, 8) -> global average pool -> fc."""

    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        block_type, counts = STAGES[cfg.depth]
        self.stem = nn.Sequential(
            *conv_bn(3, cfg.width, 7, stride=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        blocks, in_ch = [], cfg.width
        for stage, count in enumerate(counts):
            planes = cfg.width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(block_type(in_ch, planes, stride))
                in_ch = planes * block_type.expansion
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(in_ch, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] -> logits [B, num_classes]."""
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_model(cfg: ResNetConfig) -> ResNet:
    return ResNet(cfg)


def make_batch(cfg: ResNetConfig, seed: int) -> Batch:
    """Standard-normal images and uniform random labels."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=generator)
    labels = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=generator)
    return Batch(args=(images,), targets=labels)


def loss_fn(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(logits, batch.targets)


def derived_facts(cfg: ResNetConfig) -> dict:
    return {"samples_per_batch": cfg.batch_size, "images_per_batch": cfg.batch_size}
