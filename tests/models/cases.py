"""Toy models with their inputs (`helpers.step.Case`): the models every HCModule contract
test can run, each at a size where activations dominate."""

from __future__ import annotations

import torch
from helpers.step import Case
from models.toy import HFStyleLM, MaskedGPT, MLPNet, RNNTagger, TinyMobileNetV2, TinyViT
from models.traits import (
    DictInput,
    Distill,
    FrozenBackbone,
    ListInput,
    SelfCheckpointed,
    TiedAcross,
)


def tokens(b: int, t: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t))


def images(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32)


def hf_inputs():
    ids = tokens(4, 32, 120)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return (ids,), {"attention_mask": mask, "labels": labels, "output_hidden_states": True}


def dict_inputs():
    x, y = torch.randn(256, 64), torch.randn(256, 64, requires_grad=True)
    return ({"x": x, "y": y, "keep": torch.rand(256, 64) > 0.5},), {}


CASES = [
    Case("vit", TinyViT, lambda: ((torch.randn(8, 3, 32, 32),), {}), block_size=2),
    Case("mobilenetv2", TinyMobileNetV2, lambda: ((torch.randn(8, 3, 32, 32),), {}), block_size=2),
    Case("lstm_gru", RNNTagger, lambda: ((tokens(8, 24, 100),), {})),
    Case("hf_modeloutput", HFStyleLM, hf_inputs, block_size=4, own_loss=True),
    Case(
        "hf_dataclass",
        lambda: HFStyleLM(dataclass_output=True),
        hf_inputs,
        block_size=4,
        own_loss=True,
    ),
    Case(
        "causal_buffer",
        MaskedGPT,
        lambda: ((tokens(4, 40, 96), tokens(4, 40, 96)), {}),
        block_size=4,
    ),
    Case("frozen_backbone", FrozenBackbone, lambda: ((torch.randn(512, 64),), {})),
    Case(
        "self_checkpointed",
        SelfCheckpointed,
        lambda: ((torch.randn(512, 64, requires_grad=True),), {}),
    ),
    Case("tied_across", TiedAcross, lambda: ((torch.randn(512, 64, requires_grad=True),), {})),
    Case("autocast_bf16", MLPNet, lambda: ((torch.randn(512, 64),), {}), autocast=True),
    Case("list_input", ListInput, lambda: (([torch.randn(256, 64), torch.randn(256, 64)],), {})),
    Case("dict_input", DictInput, dict_inputs),
    Case("no_grad_autocast_inside", Distill, lambda: ((torch.randn(512, 64),), {})),
]
CASE = {case.name: case for case in CASES}
