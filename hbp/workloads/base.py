"""What a workload is: a model built from code with random weights, a seeded synthetic batch
and a loss, plus the model's natural block sequence for uniform checkpointing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hbp.errors import ConfigError


@dataclass
class Batch:
    """Positional and keyword inputs of `model(...)` plus the targets the loss needs."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    targets: Any = None

    def to(self, device: torch.device | str) -> Batch:
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x

        return Batch(
            tuple(move(a) for a in self.args),
            {k: move(v) for k, v in self.kwargs.items()},
            move(self.targets),
        )


@dataclass
class Workload:
    """A model and how to run one training step on it.

    Contract:
        `model.blocks` is an `nn.ModuleList` that the model's forward applies in order as
        `state = block(state)`; `state` is a tensor or a tuple of tensors. The checkpoint
        mode groups consecutive blocks into segments by replacing that list.
        `loss_fn(model(*batch.args, **batch.kwargs), batch)` is the scalar loss.
        `make_batch(seed)` builds the same batch for the same seed (CPU tensors).

    Attributes:
        name / profile: registry keys ("gpt2", "small").
        model: the nn.Module in train mode, on CPU, float32.
        make_batch: seed -> Batch.
        loss_fn: (model output, Batch) -> scalar tensor.
        config: the numbers that define the model and batch (for metrics.json).
        library: for a library's model (hbp.workloads.hf, diffusers_unet), the library
            ("transformers", "diffusers") whose own checkpointing mode=library_checkpoint
            switches on; its `blocks` are then the library's layers in forward order, for
            reading only (they take the library's arguments: not the chain above). None for
            hbp's own workloads.
    """

    name: str
    profile: str
    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[Any, Batch], torch.Tensor]
    config: dict = field(default_factory=dict)
    library: str | None = None

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.blocks

    def require_chain(self, mode: str) -> None:
        """ConfigError unless `model.blocks` is a chain that `mode` may regroup (not so for a
        library's model: its layers take the library's arguments)."""
        if self.library is not None:
            raise ConfigError(
                "mode",
                mode,
                f"a mode for workload {self.name}, a {self.library} model whose layers are not "
                "a chain of states: library_checkpoint (the library's own checkpointing), "
                "naive, tiny or compile_budget",
            )

    def step_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Forward + loss of `model` (the plain model or a mode's wrapper) on `batch`."""
        return self.loss_fn(model(*batch.args, **batch.kwargs), batch)
