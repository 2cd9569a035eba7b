"""Vision-language models (transformers): LLaVA (a CLIP vision tower, a projector and a Llama
text model; image tokens replaced by the projected patch features), trained on its
`.loss`.

Builders return `(model, step)` as in `decoders.py`."""

from __future__ import annotations

import torch

IMAGE_TOKEN = 500


def llava():
    """LlavaForConditionalGeneration: `vision_feature_layer=-2` (the vision tower's hidden
    states collected by transformers' output-capturing hooks), 16 image tokens per text."""
    import transformers as t

    vision = t.CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=64,
    )
    text = t.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    config = t.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        image_seq_length=16,  # (32 / 8) ** 2 patches
    )
    model = t.LlavaForConditionalGeneration(config)
    ids = torch.randint(3, IMAGE_TOKEN, (2, 64))
    ids[:, 2:18] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 32, 32)

    def step(m):
        m(input_ids=ids, pixel_values=pixels, labels=ids).loss.backward()

    return model, step


MODELS = {f.__name__: f for f in (llava,)}
