"""Vision models (transformers): Swin, ViT-MAE (random masking in the forward), CLIP (text and
vision towers), ConvNeXt, ResNet, Segformer, DETR (Hungarian-matched loss), DINOv2, BEiT,
MobileNetV2, EfficientNet, MobileViT and MobileViT in channels-last. Models with BatchNorm in
train mode also get their running statistics compared (`measure.buffer_error`).

Builders return `(model, step)` as in `decoders.py`."""

from __future__ import annotations

import torch

from real_models.common import image_step, tokens


def swin():
    """Swin: shifted-window attention (roll, window partition, relative position bias),
    patch merging."""
    import transformers as t

    config = t.SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=32,
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        window_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    model = t.SwinForImageClassification(config)
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


def vit_mae():
    """ViT-MAE pre-training: random patch masking (noise, argsort, gather) drawn in the
    forward, encoder on the kept patches, decoder on all; the step seeds the generator."""
    import transformers as t

    config = t.ViTMAEConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=4,
        decoder_hidden_size=32,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=4,
        decoder_intermediate_size=64,
        mask_ratio=0.75,
    )
    model = t.ViTMAEForPreTraining(config)
    x = torch.randn(4, 3, 32, 32)

    def step(m):
        torch.manual_seed(1)  # the same masks for the plain step and HCModule's
        m(pixel_values=x).loss.backward()

    return model, step


def clip():
    """CLIP: text and vision towers, projections, contrastive loss over the batch."""
    import transformers as t

    config = t.CLIPConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=4,
        ),
        projection_dim=32,
    )
    model = t.CLIPModel(config)
    ids = tokens(4, 16)
    x = torch.randn(4, 3, 32, 32)
    return model, lambda m: m(input_ids=ids, pixel_values=x, return_loss=True).loss.backward()


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
    return image_step(t.Dinov2ForImageClassification(config), x, labels)


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
    return image_step(t.BeitForImageClassification(config), x, labels)


def mobilenet_v2():
    """MobileNetV2: inverted residuals, depthwise convs, ReLU6, TensorFlow "same" padding
    computed in the forward, BatchNorm in train mode."""
    import transformers as t

    config = t.MobileNetV2Config(
        image_size=64, depth_multiplier=0.35, num_labels=10, classifier_dropout_prob=0.0
    )
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return image_step(t.MobileNetV2ForImageClassification(config), x, labels)


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
    return image_step(t.EfficientNetForImageClassification(config), x, labels)


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
    return image_step(t.MobileViTForImageClassification(config), x, labels)


def mobilevit_cl():
    """`mobilevit` in channels-last memory format, inputs too."""
    model, _ = mobilevit()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 64, 64).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (4,))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


MODELS = {
    f.__name__: f
    for f in (
        swin,
        vit_mae,
        clip,
        convnext,
        resnet,
        segformer,
        detr,
        dinov2,
        beit,
        mobilenet_v2,
        efficientnet,
        mobilevit,
        mobilevit_cl,
    )
}
