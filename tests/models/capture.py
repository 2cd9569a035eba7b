"""Models for the capture contracts: a cold vision-language model (transformers' LLaVA: CLIP
vision tower, Llama text model, `vision_feature_layer=-2`), a module that sets itself up on
its first call and then cannot be traced, and tied-head encoder-decoders (Moonshine, BART).
All built from config classes with random weights, at tiny sizes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from tests.models.real import quiet_transformers

VOCAB = 128
IMAGE_TOKEN = VOCAB - 1


def llava() -> tuple[nn.Module, dict]:
    """A LlavaForConditionalGeneration never called before (its sub-models install their
    output-capturing hooks on their first call), and its training inputs."""
    t = quiet_transformers()
    vision = t.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    text = t.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    config = t.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        image_seq_length=16,  # (32 / 8) ** 2 patches
    )
    ids = torch.randint(0, IMAGE_TOKEN, (2, 40))
    ids[:, 2:18] = IMAGE_TOKEN
    inputs = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 32, 32), "labels": ids}
    return t.LlavaForConditionalGeneration(config), inputs


def _record(module, args, output):
    return None  # a hook that only has to be there


class SetsUpThenBranches(nn.Module):
    """Installs forward hooks on its layers, a global module hook and a flag on its first
    call (as transformers' output capturing does), then branches on data: no tracer can
    capture it, and capture must leave it as it was."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if not getattr(self, "_set_up", False):
            for layer in self.layers:
                layer.register_forward_hook(_record)
            self._global_hook = module_globals.register_module_forward_hook(_record)
            self._set_up = True
        self.steps += 1
        for layer in self.layers:
            x = torch.relu(layer(x))
            if x.sum() > 0:  # data-dependent control flow
                x = x * 2
        return x


def moonshine() -> tuple[nn.Module, dict]:
    """MoonshineForConditionalGeneration with its output head tied to the decoder's
    embedding (two gradient contributions into one parameter)."""
    t = quiet_transformers()
    config = t.MoonshineConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=64,
        encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=2,
        encoder_num_attention_heads=2,
        decoder_num_attention_heads=2,
        tie_word_embeddings=True,
        decoder_start_token_id=1,
        pad_token_id=0,
    )
    labels = torch.randint(2, 8192, (2, 8))
    inputs = {"input_values": torch.randn(2, 4000), "labels": labels}
    return t.MoonshineForConditionalGeneration(config), inputs


class TiedLM(nn.Module):
    """An embedding, a block, and an output head that reads the embedding's weight (the
    linear's weight gradient is a view: autograd adds the embedding's contribution out of
    place). `head_first=True` reads the weight in an elementwise op after the head instead,
    whose fresh gradient takes the embedding's in place."""

    def __init__(self, vocab: int = 2048, width: int = 64, head_first: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head_first = head_first

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.block(h)
        logits = nn.functional.linear(h, self.embed.weight)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if self.head_first:
            loss = loss + (self.embed.weight * 1e-3).square().mean()
        return loss


class MaskedMiddle(nn.Module):
    """Two blocks around data-dependent ops: a boolean mask keeps the rows whose activations
    sum above zero (`x[mask]`) and `nonzero` picks columns, then a second block and a loss.
    Fake tensors cannot know how many rows or columns are kept (a graph break)."""

    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        self.first = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        )
        self.second = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        )

    def forward(self, x):
        h = self.first(x)
        h = h[h.sum(-1) > 0]
        columns = torch.nonzero(h.mean(0) > 0).squeeze(-1)
        h = self.second(h)
        return h.index_select(1, columns).square().mean()


def wav2vec2_bert_ctc() -> tuple[nn.Module, dict]:
    """Wav2Vec2BertForCTC with `labels=`: the labels check (`labels.max() >= vocab_size`),
    `masked_select` of the labels and CTC's loss depend on the labels' values. SpecAugment
    (numpy random masks) and LayerDrop (a random branch per layer) are off: a graph cannot
    repeat a forward's own random Python."""
    t = quiet_transformers()
    config = t.Wav2Vec2BertConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=128,
        output_hidden_size=64,
        vocab_size=32,
        feature_projection_input_dim=32,
        conv_depthwise_kernel_size=3,
        mask_time_prob=0.0,
        layerdrop=0.0,
    )
    labels = torch.randint(1, 32, (2, 12))
    labels[1, 9:] = -100
    inputs = {"input_features": torch.randn(2, 100, 32), "labels": labels}
    return t.Wav2Vec2BertForCTC(config), inputs
