"""Uniform segments of a chain of blocks, shared by the torch and JAX checkpoint modes."""

from __future__ import annotations

import math

from hbp.errors import ConfigError


def segment_bounds(
    num_blocks: int, segments: int | None = None, block_size: int | None = None
) -> list[tuple[int, int]]:
    """[start, stop) of each segment tiling `num_blocks` blocks.

    `block_size`: segments of that many blocks (the last one shorter if it does not divide).
    Otherwise `segments` segments (default round(sqrt(num_blocks)); more than num_blocks is
    clamped to one block per segment) whose lengths differ by at most one, longer ones first.
    """
    if num_blocks < 1:
        raise ValueError(f"need at least one block to checkpoint, got {num_blocks}")
    if block_size is not None:
        starts = range(0, num_blocks, block_size)
        return [(s, min(s + block_size, num_blocks)) for s in starts]
    count = segments if segments is not None else max(1, round(math.sqrt(num_blocks)))
    count = min(count, num_blocks)
    base, extra = divmod(num_blocks, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def positive_int_or_none(field: str, value) -> int | None:
    """`value` if it is None or an int >= 1, else ConfigError naming `field`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "null or an integer >= 1")
    return value
