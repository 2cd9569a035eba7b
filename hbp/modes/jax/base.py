"""What a JAX mode is: a way to differentiate the JAX workload's loss for a training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hbp.errors import ConfigError
from hbp.workloads.jax.base import JaxWorkload


class JaxMode(Protocol):
    name: str

    def apply(self, workload: JaxWorkload) -> Callable:
        """The step's gradient function `(params, *batch) -> (grads, loss)`, not jitted
        (called once, before compilation; may plan on the workload's arrays)."""

    def describe(self) -> dict:
        """The mode's parameters and results for metrics.json (flat, JSON-serialisable)."""


def refuse_chunked_loss(chunked_loss) -> None:
    """The JAX modes take `chunked_loss` (the mode config group is shared with torch) but
    have no chunked LM head: ConfigError unless it is false (conf/framework/jax.yaml sets it
    false)."""
    if chunked_loss:
        raise ConfigError(
            "mode.chunked_loss",
            chunked_loss,
            "false with framework=jax (hbp.ops.chunked_cross_entropy is a torch operator)",
        )
