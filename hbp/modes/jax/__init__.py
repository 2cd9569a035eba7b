"""hbp.modes.jax: how the bench runs a JAX workload's training step (framework=jax).

A JAX mode turns a `hbp.workloads.jax.JaxWorkload` into the step's gradient function
`(params, *batch) -> (grads, loss)`, not jitted: the bench compiles it with `jax.jit` and
measures the compiled program (hbp/bench/jax_run.py). Registered in `hbp.modes.JAX_MODES`:

- naive: `jax.grad` of the loss;
- checkpoint: the loss with consecutive blocks under `jax.checkpoint` (segments as the torch
  checkpoint mode cuts them);
- tiny: `hbp.jax.height_compressed_grad(loss, budget)`.
"""

from hbp.modes.jax.base import JaxMode

__all__ = ["JaxMode"]
