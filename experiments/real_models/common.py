"""Inputs and steps shared by the real-model zoos."""

from __future__ import annotations

import torch


def tokens(batch: int, length: int, vocab: int = 512) -> torch.Tensor:
    """Random token ids in [3, vocab): no padding, BOS or EOS ids."""
    return torch.randint(3, vocab, (batch, length))


def causal_lm_step(model, ids):
    """`(model, step)` for a causal LM trained on its own input ids through `.loss`."""
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def image_step(model, x, labels):
    """`(model, step)` for an image classifier trained through `.loss`."""
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()
