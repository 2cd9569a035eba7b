"""More models for `experiments/trial_models.py`: architectures of a third trial, each built
the same way (config class, random weights, tiny sizes, nothing downloads, dropout off) and
returning (model, step). `trial_models.py` adds `MORE` to its `MODELS`.

Covered here: Whisper (conv front end, encoder-decoder), BLOOM (ALiBi), GPT-NeoX (parallel
residual, partial rotary), Qwen2-MoE (shared expert beside routed experts, router loss),
Qwen3 (q/k RMSNorm), ConvNeXt (depthwise conv, layer scale, drop path), ResNet and Segformer
(BatchNorm in train mode: the trial also compares running statistics), DETR (ResNet
backbone, Hungarian-matched loss), diffusers AutoencoderKL (encoder, posterior sample,
decoder; MSE + KL) and SD3's MMDiT transformer (joint attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _tokens(batch, length, vocab=512):
    return torch.randint(3, vocab, (batch, length))


def _causal_lm_step(model, ids):
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def whisper():
    """Whisper: two 1-D convs over log-mel frames, sinusoidal encoder positions, decoder with
    cross-attention, labels shifted behind the decoder start token."""
    import transformers as t

    config = t.WhisperConfig(
        vocab_size=512,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=64,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = t.WhisperForConditionalGeneration(config)
    features = torch.randn(4, 16, 128)  # (B, mel bins, 2 * max_source_positions frames)
    labels = _tokens(4, 32)
    return model, lambda m: m(
        input_features=features, labels=labels, use_cache=False
    ).loss.backward()


def bloom():
    """BLOOM: ALiBi position biases (no position embeddings), embedding LayerNorm, fused QKV."""
    import transformers as t

    config = t.BloomConfig(
        vocab_size=512,
        hidden_size=128,
        n_layer=4,
        n_head=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return _causal_lm_step(t.BloomForCausalLM(config), _tokens(4, 96))


def gpt_neox():
    """GPT-NeoX: parallel residual (attention and MLP read the same input), rotary on a
    quarter of each head's dimensions."""
    import transformers as t

    config = t.GPTNeoXConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=256,
        use_parallel_residual=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    return _causal_lm_step(t.GPTNeoXForCausalLM(config), _tokens(4, 96))


def qwen2_moe():
    """Qwen2-MoE: top-2 of 4 routed experts beside a sigmoid-gated shared expert in every
    layer, the router's load-balancing loss added to the LM loss."""
    import transformers as t

    config = t.Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    return _causal_lm_step(t.Qwen2MoeForCausalLM(config), _tokens(2, 64))


def qwen3():
    """Qwen3: RMSNorm on each head's queries and keys before rotary, grouped-query attention,
    a head dimension set apart from hidden / heads."""
    import transformers as t

    config = t.Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=256,
    )
    return _causal_lm_step(t.Qwen3ForCausalLM(config), _tokens(4, 96))


def convnext():
    """ConvNeXt: 7x7 depthwise convs, channels-last LayerNorm (permutes), layer scale and
    stochastic depth (drop path 0.2, drawn in the forward: the step seeds the generator)."""
    import transformers as t

    config = t.ConvNextConfig(
        num_channels=3,
        patch_size=4,
        num_stages=3,
        hidden_sizes=[16, 32, 64],
        depths=[2, 2, 2],
        layer_scale_init_value=1e-6,
        drop_path_rate=0.2,
        image_size=64,
        num_labels=10,
    )
    model = t.ConvNextForImageClassification(config)
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


def resnet():
    """transformers ResNet (basic blocks): BatchNorm in train mode, its running statistics
    updated once per step, max-pool stem, strided shortcuts."""
    import transformers as t

    config = t.ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=10,
    )
    model = t.ResNetForImageClassification(config)
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


def segformer():
    """Segformer: overlapping patch embeddings, spatial-reduction attention (keys and values
    from a strided conv of the sequence), Mix-FFN depthwise conv, an all-MLP decode head with
    BatchNorm, logits upsampled to the label map for the cross-entropy."""
    import transformers as t

    config = t.SegformerConfig(
        num_channels=3,
        num_encoder_blocks=4,
        depths=[1, 1, 1, 1],
        sr_ratios=[8, 4, 2, 1],
        hidden_sizes=[16, 32, 64, 128],
        num_attention_heads=[1, 2, 4, 8],
        decoder_hidden_size=64,
        num_labels=5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    model = t.SegformerForSemanticSegmentation(config)
    x, labels = torch.randn(2, 3, 64, 64), torch.randint(0, 5, (2, 64, 64))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


def detr():
    """DETR object detection without timm: transformers' ResNet backbone (frozen BatchNorm),
    sine position embeddings, encoder-decoder over 10 object queries; the loss matches
    predictions to boxes with scipy's Hungarian algorithm (data-dependent, on the CPU)."""
    import transformers as t

    backbone = t.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage4"],
    )
    config = t.DetrConfig(
        use_timm_backbone=False,
        backbone_config=backbone,
        use_pretrained_backbone=False,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_queries=10,
        num_labels=5,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        auxiliary_loss=False,
    )
    model = t.DetrForObjectDetection(config)
    x = torch.randn(2, 3, 64, 64)
    labels = [
        {"class_labels": torch.tensor([1, 3]), "boxes": torch.rand(2, 4) * 0.5 + 0.25}
        for _ in range(2)
    ]
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


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


MORE = {
    f.__name__: f
    for f in (
        whisper,
        bloom,
        gpt_neox,
        qwen2_moe,
        qwen3,
        convnext,
        resnet,
        segformer,
        detr,
        autoencoder_kl,
        sd3_mmdit,
    )
}
