"""JAX mode "checkpoint": uniform rematerialisation over the workload's blocks.

The blocks are cut into segments as the torch checkpoint mode cuts them (`segment_bounds`:
`segments` segments, default round(sqrt(L)), or `block_size` blocks each; `mode.block_size=1`
is one `jax.checkpoint` per block, the usual JAX idiom); each segment runs under
`jax.checkpoint` (prevent_cse=True, no saving policy: the backward recomputes the segment from
its input).

.. warning::
    On XLA:CPU, `jax.checkpoint` inside one `jax.jit` program does not lower the compiled
    memory: a CPU pass strips its optimisation barriers and CSE merges the recomputation back
    into the forward (docs/jax.md "Recomputation under the caller's jax.jit"). The bench
    measures what XLA compiled.
"""

from __future__ import annotations

import jax

from hbp.errors import ConfigError
from hbp.modes.jax.base import refuse_chunked_loss
from hbp.modes.segments import positive_int_or_none, segment_bounds
from hbp.workloads.jax.base import JaxWorkload


class JaxCheckpointMode:
    """`jax.checkpoint` per segment of blocks; `segments` or `block_size` (at most one set).
    `chunked_loss` must be false (`refuse_chunked_loss`)."""

    name = "checkpoint"

    def __init__(
        self, segments: int | None = None, block_size: int | None = None, chunked_loss: bool = False
    ):
        refuse_chunked_loss(chunked_loss)
        self.segments = positive_int_or_none("mode.segments", segments)
        self.block_size = positive_int_or_none("mode.block_size", block_size)
        if self.segments is not None and self.block_size is not None:
            raise ConfigError(
                "mode.segments/mode.block_size",
                (segments, block_size),
                "at most one of the two set (the other null)",
            )
        self.bounds: list[tuple[int, int]] = []

    def apply(self, workload: JaxWorkload):
        self.bounds = segment_bounds(len(workload.blocks), self.segments, self.block_size)

        def loss(params, *batch):
            return workload.loss_and_aux(params, *batch, segments=self.bounds, wrap=jax.checkpoint)

        return jax.grad(loss, has_aux=True)

    def describe(self) -> dict:
        sizes = [stop - start for start, stop in self.bounds]
        return {
            "name": self.name,
            "segments": self.segments,
            "block_size": self.block_size,
            "chunked_loss": False,
            "num_blocks": sum(sizes),
            "num_segments": len(sizes),
            "segment_sizes": ",".join(map(str, sizes)),
        }
