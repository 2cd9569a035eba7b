"""Mode "naive": plain autograd, every activation kept until backward uses it."""

from __future__ import annotations

from torch import nn

from hbp.workloads.base import Batch, Workload


class NaiveMode:
    """Trains the workload's model as it is.

    `chunked_loss` is recorded only: the bench builds the workload with it (GPT-2's chunked
    LM head + cross-entropy) when the workload takes that option."""

    name = "naive"

    def __init__(self, chunked_loss: bool = False):
        self.chunked_loss = bool(chunked_loss)

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        return workload.model

    def describe(self) -> dict:
        return {"name": self.name, "chunked_loss": self.chunked_loss}
