"""What a mode is: a way to run the workload's model for a training step.

A mode turns the workload's model into the module the bench trains. It may wrap the model
or replace its `blocks`, but it keeps the same parameter objects, so gradients land in the
same `.grad` fields and can be compared with naive's in order of `model.parameters()`.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from hbp.workloads.base import Batch, Workload


class Mode(Protocol):
    name: str

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Return the module to train (called once, before warm-up; may plan on `batch`)."""

    def describe(self) -> dict:
        """The mode's parameters and results for metrics.json (flat, JSON-serialisable);
        may include plan predictions after `apply`."""
