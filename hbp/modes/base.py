"""What a mode is: a way to run the workload's model for a training step.

A mode turns the workload's model into the module the bench trains. It may wrap the model
or replace its `blocks`, but it keeps the same parameter objects, so gradients land in the
same `.grad` fields and can be compared with naive's in order of `model.parameters()`.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from hbp.errors import ConfigError
from hbp.planner import PLANNERS
from hbp.planner.budget import Budget
from hbp.workloads.base import Batch, Workload


class Mode(Protocol):
    name: str

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Return the module to train (called once, before warm-up; may plan on `batch`)."""

    def describe(self) -> dict:
        """The mode's parameters and results for metrics.json (flat, JSON-serialisable);
        may include plan predictions after `apply`."""


def check_planner_options(budget, block_size, planner) -> None:
    """The planner's options of a planning mode (tiny, torch's and JAX's), checked when the mode
    is built and named by their config keys: a bad one is refused before a run builds
    anything (ConfigError)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("mode.block_size", block_size, "an integer >= 1")
    if planner not in PLANNERS:
        raise ConfigError("mode.planner", planner, " or ".join(map(repr, PLANNERS)))
    try:
        Budget.parse(budget)
    except ConfigError as error:
        raise ConfigError("mode.budget", budget, error.accepted) from None
