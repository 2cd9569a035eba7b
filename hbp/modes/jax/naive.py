"""JAX mode "naive": `jax.grad` of the loss; under the bench's `jax.jit`, XLA keeps what the
backward needs (its own choices: fusion may recompute cheap elementwise values)."""

from __future__ import annotations

import jax

from hbp.modes.jax.base import refuse_chunked_loss
from hbp.workloads.jax.base import JaxWorkload


class JaxNaiveMode:
    """`jax.grad(loss, has_aux=True)`. `chunked_loss` must be false (`refuse_chunked_loss`):
    the JAX GPT-2 computes its logits whole."""

    name = "naive"

    def __init__(self, chunked_loss: bool = False):
        refuse_chunked_loss(chunked_loss)

    def apply(self, workload: JaxWorkload):
        return jax.grad(workload.loss_and_aux, has_aux=True)

    def describe(self) -> dict:
        return {"name": self.name, "chunked_loss": False}
