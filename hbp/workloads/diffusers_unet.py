"""A real diffusers UNet2DConditionModel (Stable Diffusion's layout) as a workload, built from
its config with random weights (nothing is downloaded).

Down path: cross-attention down blocks (ResNet blocks + a Transformer2D with self-attention,
cross-attention to the text embeddings and a GEGLU feed-forward) and one plain down block last;
a cross-attention middle block; the mirror image on the way up, with skip concatenations. The
step is a denoising step: `model(noisy, timesteps, encoder_hidden_states, noise)` returns the
MSE between the predicted and the true noise, computed inside the model, so a planner that
captures it sees the whole step.

`model` is `UNetLossModel`: the library model under `.library_model` (what
mode=library_checkpoint calls `enable_gradient_checkpointing()` on). `model.blocks` lists the
down blocks, the middle block and the up blocks in forward order (for the facts and for
reading; the blocks take the library's arguments, they are not a chain of states).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from hbp.workloads import require
from hbp.workloads.base import Batch

NUM_TIMESTEPS = 1000
LIBRARY = "diffusers"  # mode=library_checkpoint: whose checkpointing the model has


@dataclass(frozen=True)
class DiffusersUNetConfig:
    """len(channels) levels of `channels[i]` channels with layers_per_block ResNet blocks each,
    cross-attention at every level but the last (heads of head_dim channels); GroupNorm with
    `groups` groups. Batches: batch_size latents of in_channels x image_size x image_size,
    text embeddings of text_len x cross_attention_dim."""

    channels: tuple[int, ...] = (32, 64)
    layers_per_block: int = 1
    head_dim: int = 8
    groups: int = 8
    cross_attention_dim: int = 64
    text_len: int = 16
    in_channels: int = 4
    image_size: int = 16
    batch_size: int = 2

    def validate(self) -> None:
        require(
            len(self.channels) >= 2 and min(self.channels) >= 1,
            "channels",
            list(self.channels),
            "a list of at least two integers >= 1 (one per level)",
        )
        for name in ("layers_per_block", "head_dim", "groups", "cross_attention_dim"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        for name in ("text_len", "in_channels", "image_size", "batch_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(
            all(c % self.groups == 0 and c % self.head_dim == 0 for c in self.channels),
            "channels",
            list(self.channels),
            f"multiples of groups={self.groups} and head_dim={self.head_dim}",
        )
        scale = 2 ** (len(self.channels) - 1)
        require(
            self.image_size % scale == 0,
            "image_size",
            self.image_size,
            f"a multiple of {scale} (one halving per level after the first)",
        )


PROFILES = {
    # Test-sized: a step in about a tenth of a second.
    "tiny": DiffusersUNetConfig(
        channels=(16, 32), head_dim=8, groups=8, cross_attention_dim=16, text_len=4, image_size=8
    ),
    # The bench's size on CPU: 16x16 latents, 3 levels, a step in about a second.
    "small": DiffusersUNetConfig(
        channels=(32, 64, 64),
        layers_per_block=1,
        head_dim=8,
        groups=8,
        cross_attention_dim=64,
        text_len=16,
        image_size=16,
        batch_size=4,
    ),
    # Stable Diffusion 1.x widths at 64x64 latents (about 860M parameters): for a GPU.
    "medium": DiffusersUNetConfig(
        channels=(320, 640, 1280, 1280),
        layers_per_block=2,
        head_dim=40,
        groups=32,
        cross_attention_dim=768,
        text_len=77,
        image_size=64,
        batch_size=1,
    ),
}
PROFILES["large"] = replace(PROFILES["medium"], batch_size=4)  # medium, 4 images


class UNetLossModel(nn.Module):
    """A diffusers UNet whose forward returns the MSE of its noise prediction."""

    def __init__(self, library_model: nn.Module):
        super().__init__()
        self.library_model = library_model

    @property
    def blocks(self) -> nn.ModuleList:
        """Down blocks, the middle block, up blocks (a fresh list; read only)."""
        unet = self.library_model
        return nn.ModuleList([*unet.down_blocks, unet.mid_block, *unet.up_blocks])

    def forward(self, noisy, timesteps, encoder_hidden_states, noise) -> torch.Tensor:
        prediction = self.library_model(noisy, timesteps, encoder_hidden_states).sample
        return F.mse_loss(prediction, noise)


def make_model(cfg: DiffusersUNetConfig) -> UNetLossModel:
    from diffusers import UNet2DConditionModel

    levels = len(cfg.channels)
    unet = UNet2DConditionModel(
        sample_size=cfg.image_size,
        in_channels=cfg.in_channels,
        out_channels=cfg.in_channels,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        block_out_channels=cfg.channels,
        layers_per_block=cfg.layers_per_block,
        attention_head_dim=[c // cfg.head_dim for c in cfg.channels],
        norm_num_groups=cfg.groups,
        cross_attention_dim=cfg.cross_attention_dim,
    )
    return UNetLossModel(unet)


def make_batch(cfg: DiffusersUNetConfig, seed: int) -> Batch:
    """noisy = sqrt(a) x0 + sqrt(1 - a) noise for random latents x0, uniform timesteps and a
    linear-beta DDPM schedule; random text embeddings; targets = noise."""
    generator = torch.Generator().manual_seed(seed)
    shape = (cfg.batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    x0 = torch.randn(shape, generator=generator)
    noise = torch.randn(shape, generator=generator)
    t = torch.randint(0, NUM_TIMESTEPS, (cfg.batch_size,), generator=generator)
    alpha_bar = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, NUM_TIMESTEPS), dim=0)[t]
    a = alpha_bar[:, None, None, None]
    noisy = a.sqrt() * x0 + (1.0 - a).sqrt() * noise
    text = torch.randn(cfg.batch_size, cfg.text_len, cfg.cross_attention_dim, generator=generator)
    return Batch(args=(noisy, t, text, noise), targets=noise)


def loss_fn(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The model already returns the MSE to the true noise."""
    return output


def derived_facts(cfg: DiffusersUNetConfig) -> dict:
    return {"samples_per_batch": cfg.batch_size, "images_per_batch": cfg.batch_size}
