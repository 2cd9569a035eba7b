"""hbp for JAX: height-compressed reverse mode (DESIGN.md "Public API").

    import hbp.jax
    grad_fn = hbp.jax.height_compressed_grad(loss_fn, budget=0.3)   # like jax.grad
    grads = grad_fn(params, batch)
    print(grad_fn.plan)                                              # the plan it used
    report = hbp.jax.measure(grad_fn, params, batch)                 # peak bytes, RSS growth
    step = hbp.jax.jit(train_step)  # jax.jit that keeps jax.checkpoint's recompute on XLA:CPU

`height_compressed(fun, budget=...)` wraps `fun` so that `jax.grad`/`jax.vjp` of it follow the
plan. See `hbp.integrations.jax` for the two executors ("pieces", "remat") and which one saves
memory where (on XLA:CPU, `jax.checkpoint` under a plain `jax.jit` saves nothing).
"""

from hbp.integrations.jax import (
    STRATEGIES,
    MemoryReport,
    PieceRecord,
    compiler_options,
    height_compressed,
    height_compressed_grad,
    jit,
    measure,
    record_pieces,
    rss_growth,
)

__all__ = [
    "STRATEGIES",
    "compiler_options",
    "jit",
    "MemoryReport",
    "PieceRecord",
    "height_compressed",
    "height_compressed_grad",
    "measure",
    "record_pieces",
    "rss_growth",
]
