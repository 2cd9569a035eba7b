"""A diffusion-style U-Net (DDPM, Ho et al. 2020; layout of improved-diffusion's UNetModel).

A sinusoidal timestep embedding and MLP; ResBlocks (GroupNorm, SiLU, 3x3 convs, the timestep
embedding added per channel); a down path, a middle (ResBlock, attention, ResBlock) and an up
path that concatenates the down path's activations (skips); self-attention through
F.scaled_dot_product_attention at the resolutions in `attn_resolutions`. `model(x_noisy, t)`
predicts the noise; the loss is the MSE to the true noise.

The skips make the network a DAG, but `blocks` is still a chain: every block maps the state
tuple (h, emb, skip_1, ..., skip_k) to the next one. Down blocks push their output as a skip,
the middle block keeps the skips, up blocks pop the last skip and concatenate it to h.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hbp.workloads import require
from hbp.workloads.base import Batch

NUM_TIMESTEPS = 1000


@dataclass(frozen=True)
class UNetConfig:
    """Level i has base_channels x channel_mult[i] channels and num_res_blocks ResBlocks;
    every level but the last halves the resolution. GroupNorm uses `groups` groups; attention
    (num_heads heads) runs at every resolution listed in attn_resolutions and in the middle.
    Batches are batch_size x in_channels x image_size x image_size."""

    base_channels: int = 32
    channel_mult: tuple[int, ...] = (1, 2)
    num_res_blocks: int = 1
    attn_resolutions: tuple[int, ...] = (8,)
    image_size: int = 16
    in_channels: int = 3
    batch_size: int = 8
    groups: int = 8
    num_heads: int = 4

    def validate(self) -> None:
        positive = ("base_channels", "num_res_blocks", "image_size", "in_channels", "batch_size")
        for name in (*positive, "groups", "num_heads"):
            value = getattr(self, name)
            require(value >= 1, name, value, "an integer >= 1")
        require(
            len(self.channel_mult) >= 1 and min(self.channel_mult) >= 1,
            "channel_mult",
            list(self.channel_mult),
            "a non-empty list of integers >= 1",
        )
        require(
            self.base_channels % 2 == 0 and self.base_channels % self.groups == 0,
            "base_channels",
            self.base_channels,
            f"an even multiple of groups={self.groups}",
        )
        scale = 2 ** (len(self.channel_mult) - 1)
        require(
            self.image_size % scale == 0,
            "image_size",
            self.image_size,
            f"a multiple of {scale} (one halving per level after the first)",
        )
        require(
            self.base_channels % self.num_heads == 0,
            "num_heads",
            self.num_heads,
            f"a divisor of base_channels={self.base_channels}",
        )


PROFILES = {
    # Test-sized: a step in about a hundredth of a second.
    "tiny": UNetConfig(
        base_channels=16, image_size=8, batch_size=2, num_heads=2, attn_resolutions=(4,)
    ),
    # ~0.1 s per step on one CPU thread; activations ~5x the parameter gradients.
    "small": UNetConfig(),
    # The DDPM CIFAR-10 network (35.7M parameters) at 32 x 32; activations ~5x the parameter
    # gradients.
    "medium": UNetConfig(
        base_channels=128,
        channel_mult=(1, 2, 2, 2),
        num_res_blocks=2,
        attn_resolutions=(16,),
        image_size=32,
        batch_size=16,
        groups=32,
    ),
    # An ImageNet-64-style network at 64 x 64 with attention at 16 and 8.
    "large": UNetConfig(
        base_channels=128,
        channel_mult=(1, 2, 3, 4),
        num_res_blocks=2,
        attn_resolutions=(16, 8),
        image_size=64,
        batch_size=16,
        groups=32,
    ),
}


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of timesteps t [B] -> [B, dim] (dim even)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    )
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class ResBlock(nn.Module):
    """x [B, in_ch, H, W], emb [B, emb_dim] -> [B, out_ch, H, W]."""

    def __init__(self, in_ch: int, out_ch: int, emb_dim: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.shortcut(x) + h


class AttentionBlock(nn.Module):
    """Multi-head self-attention over the H x W positions: [B, C, H, W] -> [B, C, H, W]."""

    def __init__(self, channels: int, num_heads: int, groups: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, 3C, H, W] -> [3, B, heads, HW, head_dim]
        qkv = self.qkv(self.norm(x)).flatten(2).unflatten(1, (3, self.num_heads, -1))
        q, k, v = qkv.permute(1, 0, 2, 4, 3).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(2, 3).reshape(x.shape))


class Downsample(nn.Module):
    """Strided 3x3 conv: [B, C, H, W] -> [B, C, H/2, W/2]."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour x2 then 3x3 conv: [B, C, H, W] -> [B, C, 2H, 2W]."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Layers(nn.ModuleList):
    """Layers applied in order; ResBlocks also get the timestep embedding."""

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        for layer in self:
            h = layer(h, emb) if isinstance(layer, ResBlock) else layer(h)
        return h


class UNetBlock(nn.Module):
    """One step of the block chain: `layers` applied to the state's h (and emb)."""

    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.layers = Layers(layers)


class DownBlock(UNetBlock):
    """(h, emb, *skips) -> (h', emb, *skips, h'): pushes its output as a skip."""

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h = self.layers(state[0], state[1])
        return (h, state[1], *state[2:], h)


class MidBlock(UNetBlock):
    """(h, emb, *skips) -> (h', emb, *skips)."""

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (self.layers(state[0], state[1]), *state[1:])


class UpBlock(UNetBlock):
    """(h, emb, *skips, s) -> (h', emb, *skips) with h' = layers(cat(h, s)): pops a skip."""

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h = self.layers(torch.cat([state[0], state[-1]], dim=1), state[1])
        return (h, state[1], *state[2:-1])


class UNet(nn.Module):
    """Noise predictor: x_noisy [B, C, H, W], t [B] (long) -> noise estimate [B, C, H, W]."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        base, groups, heads = cfg.base_channels, cfg.groups, cfg.num_heads
        emb_dim = 4 * base
        self.base_channels = base
        self.time_mlp = nn.Sequential(
            nn.Linear(base, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim)
        )
        self.conv_in = nn.Conv2d(cfg.in_channels, base, 3, padding=1)

        blocks, skip_channels = [], [base]  # conv_in's output is the first skip
        ch, res = base, cfg.image_size
        last_level = len(cfg.channel_mult) - 1
        for level, mult in enumerate(cfg.channel_mult):
            for _ in range(cfg.num_res_blocks):
                layers = [ResBlock(ch, base * mult, emb_dim, groups)]
                ch = base * mult
                if res in cfg.attn_resolutions:
                    layers.append(AttentionBlock(ch, heads, groups))
                blocks.append(DownBlock(*layers))
                skip_channels.append(ch)
            if level != last_level:
                blocks.append(DownBlock(Downsample(ch)))
                skip_channels.append(ch)
                res //= 2
        blocks.append(
            MidBlock(
                ResBlock(ch, ch, emb_dim, groups),
                AttentionBlock(ch, heads, groups),
                ResBlock(ch, ch, emb_dim, groups),
            )
        )
        for level, mult in reversed(list(enumerate(cfg.channel_mult))):
            for i in range(cfg.num_res_blocks + 1):
                layers = [ResBlock(ch + skip_channels.pop(), base * mult, emb_dim, groups)]
                ch = base * mult
                if res in cfg.attn_resolutions:
                    layers.append(AttentionBlock(ch, heads, groups))
                if level != 0 and i == cfg.num_res_blocks:
                    layers.append(Upsample(ch))
                    res *= 2
                blocks.append(UpBlock(*layers))
        self.blocks = nn.ModuleList(blocks)
        self.norm_out = nn.GroupNorm(groups, ch)
        self.conv_out = nn.Conv2d(ch, cfg.in_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.time_mlp(timestep_embedding(t, self.base_channels))
        h = self.conv_in(x)
        state = (h, emb, h)
        for block in self.blocks:
            state = block(state)
        return self.conv_out(F.silu(self.norm_out(state[0])))


def make_model(cfg: UNetConfig) -> UNet:
    return UNet(cfg)


def make_batch(cfg: UNetConfig, seed: int) -> Batch:
    """x_noisy = sqrt(a) x0 + sqrt(1 - a) noise for random images x0, uniform timesteps t and
    a linear-beta DDPM schedule; targets = noise."""
    generator = torch.Generator().manual_seed(seed)
    shape = (cfg.batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    x0 = torch.randn(shape, generator=generator)
    noise = torch.randn(shape, generator=generator)
    t = torch.randint(0, NUM_TIMESTEPS, (cfg.batch_size,), generator=generator)
    alpha_bar = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, NUM_TIMESTEPS), dim=0)[t]
    a = alpha_bar[:, None, None, None]
    x_noisy = a.sqrt() * x0 + (1.0 - a).sqrt() * noise
    return Batch(args=(x_noisy, t), targets=noise)


def loss_fn(noise_pred: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.mse_loss(noise_pred, batch.targets)


def derived_facts(cfg: UNetConfig) -> dict:
    return {"samples_per_batch": cfg.batch_size, "images_per_batch": cfg.batch_size}
