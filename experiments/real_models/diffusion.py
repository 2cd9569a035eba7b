"""Diffusion models (diffusers), trained with an MSE on the predicted noise or velocity:
PixArt-alpha, UNet2DModel (channels-last, bf16 autocast), UNet2DConditionModel (Stable
Diffusion's), AutoencoderKL, SD3's MMDiT, DiT, Flux (and Flux under bf16 autocast),
UNet1DModel, a ControlNet feeding a frozen conditional UNet, and two video models: CogVideoX's
transformer and Stable Video Diffusion's spatio-temporal UNet.

Builders return `(model, step)` as in `decoders.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pixart():
    """diffusers PixArt-alpha transformer: patch embedding, adaLN-single timestep
    conditioning, cross-attention to a caption, MSE on the predicted noise."""
    import diffusers

    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        cross_attention_dim=64,
        caption_channels=32,
        sample_size=16,
        patch_size=2,
        norm_num_groups=1,
        use_additional_conditions=False,
    )
    x = torch.randn(2, 4, 16, 16)
    caption = torch.randn(2, 12, 32)
    step_t = torch.tensor([10, 500])
    target = torch.randn(2, 4, 16, 16)

    def step(m):
        out = m(x, encoder_hidden_states=caption, timestep=step_t).sample
        F.mse_loss(out, target).backward()

    return model, step


def unet2d_cl_bf16():
    """diffusers UNet2DModel (unconditional: down/up blocks, attention, group norm) in
    channels_last, its forward under CPU bf16 autocast, MSE on the output."""
    import diffusers

    model = diffusers.UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=16,
        attention_head_dim=16,
    ).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    target = torch.randn(2, 3, 32, 32)
    timesteps = torch.tensor([3, 700])

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x, timesteps).sample
        F.mse_loss(out.float(), target).backward()

    return model, step


def sd_unet():
    """diffusers UNet2DConditionModel (Stable Diffusion's): cross-attention to text
    embeddings, timestep embedding, MSE on the predicted noise."""
    import diffusers

    model = diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    x = torch.randn(2, 4, 16, 16)
    timesteps = torch.tensor([10, 500])
    text = torch.randn(2, 8, 32)
    noise = torch.randn(2, 4, 16, 16)
    return model, lambda m: F.mse_loss(
        m(x, timesteps, encoder_hidden_states=text).sample, noise
    ).backward()


class _VAEStep(nn.Module):
    """A VAE training forward as a user writes it: encode, sample the posterior, decode;
    returns the reconstruction and the KL term (AutoencoderKL.forward drops the posterior)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, x):
        posterior = self.vae.encode(x).latent_dist
        reconstruction = self.vae.decode(posterior.sample()).sample
        return reconstruction, posterior.kl().mean()


def autoencoder_kl():
    """diffusers AutoencoderKL: ResNet encoder/decoder blocks with group norm, mid-block
    self-attention, a Gaussian posterior sampled in the forward (the step seeds the
    generator); loss = reconstruction MSE + 1e-3 KL."""
    import diffusers

    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=32,
    )
    x = torch.randn(2, 3, 32, 32)

    def step(m):
        reconstruction, kl = m(x)
        (F.mse_loss(reconstruction, x) + 1e-3 * kl).backward()

    return _VAEStep(vae), step


def sd3_mmdit():
    """diffusers SD3Transformer2DModel (MMDiT): joint attention over image patches and text
    tokens with separate weights per stream, adaLN-zero from timestep + pooled text, the last
    block's text stream context-pre-only; MSE on the predicted velocity."""
    import diffusers

    model = diffusers.SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=64,
        pooled_projection_dim=32,
        pos_embed_max_size=16,
    )
    x = torch.randn(2, 4, 16, 16)
    text, pooled = torch.randn(2, 12, 32), torch.randn(2, 32)
    step_t = torch.tensor([10.0, 500.0])
    target = torch.randn(2, 4, 16, 16)

    def step(m):
        out = m(x, encoder_hidden_states=text, pooled_projections=pooled, timestep=step_t)
        F.mse_loss(out.sample, target).backward()

    return model, step


def dit():
    """diffusers DiT: patch embedding, adaLN-zero from timestep + class label (labels dropped
    at random with probability 0.1 in training: the step seeds the generator), learned
    sigma (8 output channels, the MSE on the first 4)."""
    import diffusers

    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=4,
        sample_size=16,
        patch_size=2,
        num_embeds_ada_norm=1000,
    )
    x, target = torch.randn(2, 4, 16, 16), torch.randn(2, 4, 16, 16)
    step_t, classes = torch.tensor([10, 500]), torch.tensor([3, 7])

    def step(m):
        torch.manual_seed(1)  # the same label drops for the plain step and HCModule's
        out = m(x, timestep=step_t, class_labels=classes).sample
        F.mse_loss(out[:, :4], target).backward()

    return model, step


def flux():
    """diffusers FluxTransformer2DModel: one double-stream (MMDiT) block, two single-stream
    blocks, 3-axis rotary positions from image and text ids, packed latents."""
    import diffusers

    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    h = w = 8
    latents, target = torch.randn(2, h * w, 16), torch.randn(2, h * w, 16)
    text, pooled = torch.randn(2, 12, 32), torch.randn(2, 32)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    img_ids = img_ids.reshape(h * w, 3)
    txt_ids = torch.zeros(12, 3)
    step_t = torch.tensor([0.1, 0.7])

    def step(m):
        out = m(
            latents,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=step_t,
            img_ids=img_ids,
            txt_ids=txt_ids,
        ).sample
        F.mse_loss(out, target).backward()

    return model, step


def flux_bf16():
    """`flux`'s step (forward, MSE and backward) inside a CPU bf16 autocast block."""
    model, plain_step = flux()

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_step(m)

    return model, step


def unet1d():
    """diffusers UNet1DModel (Dance Diffusion's layout): Fourier time features concatenated
    as extra channels, 1-D down/up blocks with self-attention, no-skip outer blocks."""
    import diffusers

    model = diffusers.UNet1DModel(
        sample_size=256,
        in_channels=2,
        out_channels=2,
        extra_in_channels=64,  # the Fourier features: 2 x block_out_channels[0]
        block_out_channels=(32, 32, 64),
    )
    x, target = torch.randn(2, 2, 256), torch.randn(2, 2, 256)
    step_t = torch.tensor([0.2, 0.9])
    return model, lambda m: F.mse_loss(m(x, step_t).sample, target).backward()


class _ControlNetStep(nn.Module):
    """ControlNet training as users write it: the ControlNet's residuals fed into a frozen
    UNet2DConditionModel; only the ControlNet's parameters train."""

    def __init__(self, controlnet, unet):
        super().__init__()
        self.controlnet, self.unet = controlnet, unet.requires_grad_(False)

    def forward(self, x, t, text, cond):
        down, mid = self.controlnet(
            x, t, encoder_hidden_states=text, controlnet_cond=cond, return_dict=False
        )
        return self.unet(
            x,
            t,
            encoder_hidden_states=text,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample


def controlnet():
    """diffusers ControlNetModel (conditioning image encoder, zero convs) with a frozen
    conditional UNet; MSE on the UNet's predicted noise."""
    import diffusers

    blocks = dict(
        in_channels=4,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    unet = diffusers.UNet2DConditionModel(
        sample_size=16,
        out_channels=4,
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        **blocks,
    )
    control = diffusers.ControlNetModel(conditioning_embedding_out_channels=(16, 32), **blocks)
    x, noise = torch.randn(2, 4, 16, 16), torch.randn(2, 4, 16, 16)
    step_t, text = torch.tensor([10, 500]), torch.randn(2, 8, 32)
    cond = torch.randn(2, 3, 32, 32)  # one stride-2 conv in the conditioning embedding
    return _ControlNetStep(control, unet), lambda m: F.mse_loss(
        m(x, step_t, text, cond), noise
    ).backward()


def cogvideox():
    """diffusers CogVideoXTransformer3DModel (video: patches over frames, 3-D rotary
    positions, text and video tokens in one attention), MSE on the predicted noise."""
    import diffusers

    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=32,
        text_embed_dim=32,
        num_layers=2,
        sample_width=16,
        sample_height=16,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
        use_rotary_positional_embeddings=True,
        dropout=0.0,
    )
    x = torch.randn(2, 3, 4, 16, 16)  # (batch, frames, channels, height, width)
    text = torch.randn(2, 8, 32)
    step_t = torch.tensor([10, 500])
    target = torch.randn(2, 3, 4, 16, 16)

    def step(m):
        out = m(x, encoder_hidden_states=text, timestep=step_t).sample
        F.mse_loss(out, target).backward()

    return model, step


def svd_unet():
    """diffusers UNetSpatioTemporalConditionModel (Stable Video Diffusion's: spatial and
    temporal convolutions and attention, added time ids), MSE on the predicted noise."""
    import diffusers

    model = diffusers.UNetSpatioTemporalConditionModel(
        sample_size=16,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        block_out_channels=(32, 64),
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24,
        layers_per_block=1,
        cross_attention_dim=32,
        transformer_layers_per_block=1,
        num_attention_heads=(2, 4),
        num_frames=3,
    )
    x = torch.randn(1, 3, 8, 16, 16)  # (batch, frames, channels, height, width)
    image = torch.randn(1, 1, 32)
    time_ids = torch.tensor([[6.0, 127.0, 0.02]])
    step_t = torch.tensor([10])
    target = torch.randn(1, 3, 4, 16, 16)

    def step(m):
        out = m(x, step_t, encoder_hidden_states=image, added_time_ids=time_ids).sample
        F.mse_loss(out, target).backward()

    return model, step


MODELS = {
    f.__name__: f
    for f in (
        pixart,
        unet2d_cl_bf16,
        sd_unet,
        autoencoder_kl,
        sd3_mmdit,
        dit,
        flux,
        flux_bf16,
        unet1d,
        controlnet,
        cogvideox,
        svd_unet,
    )
}
