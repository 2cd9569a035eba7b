"""Real architectures, built from their libraries' config classes with random weights (no
download), at tiny sizes where activations still dominate: transformers GPT-2, Llama, BERT,
T5, ViT and diffusers' conditional UNet; and the two patterns of timm / torchvision CNNs that
used to crash capture (timm and torchvision stay out of the test environment: their only
wheel for this torch is a CUDA build): an alias of the input followed by an in-place
activation (timm's ResNet: `drop_block = nn.Identity()` then `nn.ReLU(inplace=True)`), and
`torch.flatten` followed by `nn.Dropout(inplace=True)` (torchvision's EfficientNet head).

Each case builds (model, args, kwargs, loss) where `loss(output)` is the scalar the training
step backpropagates: the model's own loss where it computes one (labels given)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 128


@dataclasses.dataclass
class RealCase:
    name: str
    build: Callable[[], tuple[nn.Module, tuple, dict]]
    loss: Callable[[Any], torch.Tensor]
    exact: bool = True  # bitwise equal outputs and gradients
    own_checkpointing: str = ""  # how the library switches its own checkpointing on


def quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers


def _tokens(batch: int = 4, length: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length))


def gpt2():
    t = quiet_transformers()
    config = t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128)
    ids = _tokens()
    return t.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}


def llama():
    t = quiet_transformers()
    config = t.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: the attention mask is built from it in forward
    return t.LlamaForCausalLM(config), (), {"input_ids": ids, "attention_mask": mask, "labels": ids}


def bert():
    t = quiet_transformers()
    config = t.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=VOCAB,
    )
    ids = _tokens()
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    return t.BertForMaskedLM(config), (), {"input_ids": ids, "labels": labels}


def t5():
    t = quiet_transformers()
    config = t.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=64,
        d_ff=128,
        num_heads=4,
        d_kv=16,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return t.T5ForConditionalGeneration(config), (), {"input_ids": _tokens(), "labels": _tokens()}


def pegasus():
    """Pegasus, encoder-decoder with dropout everywhere: its checkpoints keep generator
    states."""
    t = quiet_transformers()
    config = t.PegasusConfig(
        vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    ids, labels = torch.randint(2, 512, (4, 64)), torch.randint(2, 512, (4, 48))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return t.PegasusForConditionalGeneration(config), (), kwargs


def vit():
    t = quiet_transformers()
    config = t.ViTConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
        num_labels=10,
        hidden_dropout_prob=0.1,
    )
    inputs = {"pixel_values": torch.randn(4, 3, 64, 64), "labels": torch.tensor([1, 2, 3, 4])}
    return t.ViTForImageClassification(config), (), inputs


def unet_cond():
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=32,
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
    args = (torch.randn(4, 4, 32, 32), torch.tensor([10, 20, 30, 40]))
    return model, args, {"encoder_hidden_states": torch.randn(4, 7, 32)}


# Models of the regression tests that pin how transformers' attention masks are captured and
# how wav2vec2's CTC loss is (each seeded: the tests compare two copies of it).


def albert_mlm():
    t = quiet_transformers()
    torch.manual_seed(0)
    config = t.AlbertConfig(
        vocab_size=256,
        embedding_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        max_position_embeddings=96,
    )
    return t.AlbertForMaskedLM(config).train()


def qwen3_lm():
    t = quiet_transformers()
    torch.manual_seed(0)
    config = t.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
    )
    return t.Qwen3ForCausalLM(config).train()


def wav2vec2_ctc():
    t = quiet_transformers()
    torch.manual_seed(0)
    config = t.Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        layerdrop=0.0,
        pad_token_id=0,
    )
    return t.Wav2Vec2ForCTC(config).train()


class AliasThenInplace(nn.Module):
    """timm's ResNet basic block: conv, BatchNorm, `drop_block = nn.Identity()` (an alias of
    its input), `nn.ReLU(inplace=True)`, conv, BatchNorm, the residual `+=` and another
    in-place ReLU."""

    def __init__(self, channels: int = 16, blocks: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "conv1": nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                    "bn1": nn.BatchNorm2d(channels),
                    "drop_block": nn.Identity(),
                    "act1": nn.ReLU(inplace=True),
                    "conv2": nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                    "bn2": nn.BatchNorm2d(channels),
                    "act2": nn.ReLU(inplace=True),
                }
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            shortcut = x
            x = b["act1"](b["drop_block"](b["bn1"](b["conv1"](x))))
            x = b["bn2"](b["conv2"](x))
            x += shortcut
            x = b["act2"](x)
        return self.head(x.mean((2, 3)))


class FlattenThenInplaceDropout(nn.Module):
    """torchvision's EfficientNet head: pooled features, `torch.flatten`, then
    `nn.Dropout(inplace=True)` on the flattened view."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.SiLU(inplace=True),
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels),
            nn.BatchNorm2d(channels),
            nn.SiLU(inplace=True),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.2, inplace=True), nn.Linear(4 * channels, 10)
        )

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _images():
    return (torch.randn(8, 3, 32, 32),), {}


def _model_loss(output) -> torch.Tensor:
    return output.loss


def _sample_loss(output) -> torch.Tensor:
    return output.sample.float().square().mean()


def _logits_loss(output) -> torch.Tensor:
    return output.float().square().mean()


_TRANSFORMERS = "transformers"
REAL_CASES = [
    RealCase("gpt2", gpt2, _model_loss, own_checkpointing=_TRANSFORMERS),
    RealCase("llama", llama, _model_loss, exact=False, own_checkpointing=_TRANSFORMERS),
    RealCase("bert", bert, _model_loss, own_checkpointing=_TRANSFORMERS),
    RealCase("t5", t5, _model_loss, own_checkpointing=_TRANSFORMERS),
    RealCase("vit", vit, _model_loss, own_checkpointing=_TRANSFORMERS),
    RealCase("unet_cond", unet_cond, _sample_loss, own_checkpointing="diffusers"),
    RealCase("alias_then_inplace", lambda: (AliasThenInplace(), *_images()), _logits_loss),
    RealCase(
        "flatten_then_inplace_dropout",
        lambda: (FlattenThenInplaceDropout(), *_images()),
        _logits_loss,
    ),
]
REAL_CASE = {case.name: case for case in REAL_CASES}


def own_checkpointing(model: nn.Module, case: RealCase) -> None:
    """Switch the library's own activation checkpointing on."""
    if case.own_checkpointing == _TRANSFORMERS:
        model.activation_checkpointing_enable({"use_reentrant": False})
    elif case.own_checkpointing == "diffusers":
        model.enable_gradient_checkpointing()
    else:
        raise ValueError(f"{case.name} has no checkpointing of its own")
