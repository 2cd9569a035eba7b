"""Models of a fourth trial for `experiments/trial_models.py`: architectures no earlier trial
used, each built the same way (config class, random weights, tiny sizes, nothing downloads,
dropout off) and returning (model, step). `trial_models.py` adds `FOURTH` to its `MODELS`.

Covered here: Phi-3 (fused QKV and gate-up projections), Falcon (new decoder architecture:
two LayerNorms, parallel attention and MLP, grouped KV), OPT (post-LN, embeddings projected in
and out), GPT-J (interleaved rotary on part of each head, parallel residual), ModernBERT
(alternating sliding-window / global attention, GeGLU), DINOv2 (layer scale, position
embeddings interpolated bicubically to a larger image), BEiT (relative position bias, mean
pooling), MobileNetV2 and EfficientNet (BatchNorm in train mode, depthwise convs, TF padding,
squeeze-excitation), MobileViT (convs and transformers over unfolded patches), Marian
(encoder-decoder, sinusoidal positions), diffusers DiT (adaLN-zero, class labels dropped at
random), Flux (double- and single-stream blocks, 3-axis rotary), UNet1DModel (Fourier time
features) and ControlNet feeding a frozen conditional UNet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _tokens(batch, length, vocab=512):
    return torch.randint(3, vocab, (batch, length))


def _causal_lm_step(model, ids):
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def _image_step(model, x, labels):
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


# ----------------------------------------------------------------------------- decoders


def phi3():
    """Phi-3: fused QKV and gate-up projections (split in the forward), grouped-query
    attention, RMSNorm, rotary."""
    import transformers as t

    config = t.Phi3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm_step(t.Phi3ForCausalLM(config), _tokens(4, 96))


def falcon():
    """Falcon's new decoder architecture: separate LayerNorms for attention and MLP, both
    reading the same input (parallel), grouped KV heads, rotary, tied embeddings."""
    import transformers as t

    config = t.FalconConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        parallel_attn=True,
        alibi=False,
        bias=False,
        max_position_embeddings=256,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm_step(t.FalconForCausalLM(config), _tokens(4, 96))


def opt():
    """OPT (350m-style): post-LayerNorm, learned positions offset by 2, embeddings narrower
    than the model (project_in / project_out)."""
    import transformers as t

    config = t.OPTConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        ffn_dim=256,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=64,
        do_layer_norm_before=False,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
    )
    return _causal_lm_step(t.OPTForCausalLM(config), _tokens(4, 96))


def gptj():
    """GPT-J: rotary on the first 16 of 32 dimensions of each head, interleaved
    (rotate-every-two), attention and MLP in parallel off one LayerNorm."""
    import transformers as t

    config = t.GPTJConfig(
        vocab_size=512,
        n_positions=128,
        n_embd=128,
        n_layer=4,
        n_head=4,
        rotary_dim=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _causal_lm_step(t.GPTJForCausalLM(config), _tokens(4, 96))


# ----------------------------------------------------------------------------- encoders


def modernbert():
    """ModernBERT masked LM: global attention every other layer, 32-token sliding window in
    the others, GeGLU MLP, rotary, no biases."""
    import transformers as t

    config = t.ModernBertConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        layer_types=["full_attention", "sliding_attention"] * 2,
        local_attention=32,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    model = t.ModernBertForMaskedLM(config)
    ids = _tokens(4, 96)
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    return model, lambda m: m(input_ids=ids, labels=labels).loss.backward()


def dinov2():
    """DINOv2 classifier: layer scale, CLS + mean-patch head, its 32x32 position embeddings
    interpolated bicubically to a 48x48 image in every forward."""
    import transformers as t

    config = t.Dinov2Config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        mlp_ratio=2,
        image_size=32,
        patch_size=4,
        num_labels=10,
    )
    x, labels = torch.randn(4, 3, 48, 48), torch.randint(0, 10, (4,))
    return _image_step(t.Dinov2ForImageClassification(config), x, labels)


def beit():
    """BEiT classifier: a relative position bias table per layer (gathered by an index
    buffer), layer scale, mean pooling."""
    import transformers as t

    config = t.BeitConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=4,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        layer_scale_init_value=0.1,
        drop_path_rate=0.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    x, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    return _image_step(t.BeitForImageClassification(config), x, labels)


# ----------------------------------------------------------------------------- vision CNNs


def mobilenet_v2():
    """MobileNetV2: inverted residuals, depthwise convs, ReLU6, TensorFlow "same" padding
    computed in the forward, BatchNorm in train mode."""
    import transformers as t

    config = t.MobileNetV2Config(
        image_size=64, depth_multiplier=0.35, num_labels=10, classifier_dropout_prob=0.0
    )
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return _image_step(t.MobileNetV2ForImageClassification(config), x, labels)


def efficientnet():
    """EfficientNet: MBConv blocks with squeeze-excitation (a sigmoid gate per channel),
    swish, depthwise convs, BatchNorm in train mode."""
    import transformers as t

    config = t.EfficientNetConfig(
        image_size=64,
        width_coefficient=0.25,
        depth_coefficient=0.5,
        hidden_dim=320,  # round_filters(1280): the top conv's width
        num_labels=10,
        dropout_rate=0.0,
        drop_connect_rate=0.0,
    )
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return _image_step(t.EfficientNetForImageClassification(config), x, labels)


def mobilevit():
    """MobileViT (xxs widths): MobileNetV2 blocks, then transformers over 2x2 patches
    unfolded from the feature map and folded back, BatchNorm in train mode."""
    import transformers as t

    config = t.MobileViTConfig(
        image_size=64,
        hidden_sizes=[32, 48, 64],
        neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 160],
        expand_ratio=2.0,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return _image_step(t.MobileViTForImageClassification(config), x, labels)


# ----------------------------------------------------------------------------- seq2seq


def marian():
    """Marian MT: encoder-decoder with fixed sinusoidal positions, scaled embeddings, a
    final-logits bias buffer."""
    import transformers as t

    config = t.MarianConfig(
        vocab_size=512,
        decoder_vocab_size=512,
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = t.MarianMTModel(config)
    ids, labels = _tokens(4, 96), _tokens(4, 64)
    return model, lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss.backward()


# ----------------------------------------------------------------------------- diffusers


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


FOURTH = {
    f.__name__: f
    for f in (
        phi3,
        falcon,
        opt,
        gptj,
        modernbert,
        dinov2,
        beit,
        mobilenet_v2,
        efficientnet,
        mobilevit,
        marian,
        dit,
        flux,
        unet1d,
        controlnet,
    )
}
