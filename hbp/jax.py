"""hbp for JAX: height-compressed reverse mode (docs/architecture.md "Public API").

    import hbp.jax
    grad_fn = hbp.jax.height_compressed_grad(loss_fn, budget=0.3)   # like jax.grad
    step = jax.jit(lambda p, b: sgd(p, grad_fn(p, b)))               # the saving survives jit
    grads = grad_fn(params, batch)                                   # ... and called as is
    print(grad_fn.plan)                                              # the plan it used
    report = hbp.jax.measure(grad_fn, params, batch)                 # peak bytes, RSS growth

`height_compressed(fun, budget=...)` wraps `fun` so that `jax.grad`/`jax.vjp` of it follow the
plan. See `hbp.integrations.jax` for the executors ("fenced", the default; "pieces";
"remat", which needs `hbp.jax.jit` on XLA:CPU) and their trade-offs.
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
