"""JAX integration: `height_compressed`, `height_compressed_grad`, `jit` and `measure`.

A function is captured as a jaxpr (`hbp.graph.jax_capture`), planned with hbp's planner on the
framework-neutral graph, and executed segment by segment following the plan. The package
reads in pipeline order, one concern per module:

- `segments`: a plan's segments resolved against the captured `Program` (what each reads,
  makes and hands on), and evaluating their equations.
- `planning`: capture + plan per input signature, cached (`Compiled`).
- `arguments`: arguments as `jax.grad` takes them (argnums, static leaves, kwargs).
- `remat`: the one-program executors, "fenced" and "remat", which run in the caller's trace.
- `pieces`: the "pieces" executor, every segment its own compiled program.
- `recording`, `measure`: the memory of what ran.
- `api`: `height_compressed`, `height_compressed_grad`.

Executors (`strategy=`):

- "fenced" (one program): every recomputed segment is a `jax.custom_vjp` whose backward
  recomputes it inside a `lax.cond` that XLA cannot fold: the recomputation is a separate
  computation the compiler cannot merge back into the forward, so the saving survives the
  caller's plain `jax.jit` (see NOTE [ Recomputation under the caller's jax.jit ] in
  `remat`). No forward-mode differentiation (custom_vjp).
- "remat" (one program): recomputed segments under `jax.checkpoint(prevent_cse=True)`.
  Composes with everything (`jax.jvp` included), but XLA:CPU's default passes undo the
  recomputation under a plain `jax.jit`: compile with `hbp.jax.jit` (`compiler_options()`).
- "pieces" (separately compiled pieces driven from Python; needs concrete arrays): a plain
  segment runs `jax.vjp` keeping exactly the primal values the memory model says, a
  recomputed one keeps its inputs; backward runs in reverse, each recomputed segment
  recomputing and backpropagating in one program. Arrays are dropped as soon as no later
  piece needs them, so the step's peak follows the planner's model whatever the compiler does.

`strategy="auto"` (the default) runs "fenced": one program, compiled once per signature when
`height_compressed_grad` is called eagerly, inlined in the caller's trace under
`jax.jit`/`jax.vmap`. (`jax.grad` of a `height_compressed` function called eagerly runs the
pieces: its custom_vjp's forward sees concrete arrays and nothing would compile one program.)
"""

from hbp.integrations.jax.api import (
    HeightCompressed,
    HeightCompressedGrad,
    height_compressed,
    height_compressed_grad,
)
from hbp.integrations.jax.measure import MemoryReport, measure, rss_growth
from hbp.integrations.jax.planning import STRATEGIES
from hbp.integrations.jax.recording import PieceRecord, record_pieces
from hbp.integrations.jax.remat import compiler_options, jit

__all__ = [
    "STRATEGIES",
    "HeightCompressed",
    "HeightCompressedGrad",
    "MemoryReport",
    "PieceRecord",
    "height_compressed",
    "height_compressed_grad",
    "compiler_options",
    "jit",
    "measure",
    "record_pieces",
    "rss_growth",
]
