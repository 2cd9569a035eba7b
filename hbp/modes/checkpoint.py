"""Mode "checkpoint": uniform activation checkpointing over the workload's blocks.

The workload's `model.blocks` (applied in order as `state = block(state)`) is cut into
consecutive segments of near-equal length; each segment runs under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`, so its forward keeps only its input
and its backward first runs the segment forward again (Chen et al. 2016: about sqrt(L)
segments gives O(sqrt(L)) activation memory for one extra forward of the blocks). Unlike
`torch.utils.checkpoint.checkpoint_sequential`, the last segment is checkpointed too: its
activations are then not alive while the loss head runs, and every block is recomputed once.

Recomputation is invisible: RNG state is replayed (same dropout masks) and BatchNorm running
statistics are updated once per step, not again in the recompute
(`hbp.runtime.recompute.checkpoint_context_fn`).
"""

from __future__ import annotations

import warnings

import torch
import torch._dynamo  # noqa: F401  checkpoint() imports it on first call: pay that here, untimed
from torch import nn
from torch.utils.checkpoint import checkpoint

from hbp.errors import ConfigError
from hbp.modes.segments import positive_int_or_none, segment_bounds
from hbp.runtime.recompute import checkpoint_context_fn
from hbp.workloads.base import Batch, Workload

__all__ = ["CheckpointMode", "CheckpointedSegment", "segment_bounds"]


class CheckpointedSegment(nn.Module):
    """Consecutive blocks run as one checkpointed region (the same block modules, so the same
    parameter objects). `state` may be a tensor or a tuple of tensors."""

    def __init__(self, blocks: list[nn.Module], start: int):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.start = start
        self._context_fn = checkpoint_context_fn(self.blocks)

    def run(self, state):
        for block in self.blocks:
            state = block(state)
        return state

    def forward(self, state):
        if not torch.is_grad_enabled():
            return self.run(state)
        return checkpoint(self.run, state, use_reentrant=False, context_fn=self._context_fn)

    def extra_repr(self) -> str:
        return f"blocks {self.start}..{self.start + len(self.blocks) - 1}"


class CheckpointMode:
    """Uniform checkpointing: `segments` segments (default round(sqrt(L))) or `block_size`
    blocks per segment (set at most one of them). `chunked_loss` is recorded; the bench builds
    the workload with it where the workload takes that option."""

    name = "checkpoint"

    def __init__(
        self, segments: int | None = None, block_size: int | None = None, chunked_loss: bool = False
    ):
        self.segments = positive_int_or_none("mode.segments", segments)
        self.block_size = positive_int_or_none("mode.block_size", block_size)
        if self.segments is not None and self.block_size is not None:
            raise ConfigError(
                "mode.segments/mode.block_size",
                (segments, block_size),
                "at most one of the two set (the other null)",
            )
        self.chunked_loss = bool(chunked_loss)
        self.bounds: list[tuple[int, int]] = []

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Replace `workload.model.blocks` by a ModuleList of `CheckpointedSegment`s holding the
        same blocks; return the model."""
        workload.require_chain(self.name)
        blocks = list(workload.model.blocks)
        if self.segments is not None and self.segments > len(blocks):
            warnings.warn(
                f"mode.segments={self.segments} is more than the model's {len(blocks)} blocks: "
                f"it runs {len(blocks)} segments of one block (num_segments in the metrics)",
                stacklevel=2,
            )
        self.bounds = segment_bounds(len(blocks), self.segments, self.block_size)
        workload.model.blocks = nn.ModuleList(
            CheckpointedSegment(blocks[start:stop], start) for start, stop in self.bounds
        )
        return workload.model

    def describe(self) -> dict:
        sizes = [stop - start for start, stop in self.bounds]
        return {
            "name": self.name,
            "segments": self.segments,
            "block_size": self.block_size,
            "chunked_loss": self.chunked_loss,
            "num_blocks": sum(sizes),
            "num_segments": len(sizes),
            "segment_sizes": ",".join(map(str, sizes)),
        }
