"""What a JAX mode is: a way to differentiate the JAX workload's loss for a training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hbp.workloads.jax.base import JaxWorkload


class JaxMode(Protocol):
    name: str

    def apply(self, workload: JaxWorkload) -> Callable:
        """The step's gradient function `(params, *batch) -> (grads, loss)`, not jitted
        (called once, before compilation; may plan on the workload's arrays)."""

    def describe(self) -> dict:
        """The mode's parameters and results for metrics.json (flat, JSON-serialisable)."""
