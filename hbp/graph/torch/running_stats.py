"""Normalisation layers that track running statistics (BatchNorm, SyncBatchNorm, InstanceNorm
with `track_running_stats=True`), and a context in which they update throw-away copies: what
a recomputed forward, and a capture that runs the forward for real, must not update twice
(pytorch#96136; see `hbp.runtime.recompute`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["NORM_STATISTICS", "frozen_running_stats", "stat_tracking_norms"]

#: The buffers a norm layer updates in training.
NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def stat_tracking_norms(module: nn.Module) -> list[_NormBase]:
    """Normalisation layers under `module` that would update running statistics in training."""
    return [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]


@contextlib.contextmanager
def frozen_running_stats(norms: list[_NormBase]) -> Iterator[None]:
    """Inside: the given training-mode norm layers update throw-away copies of their running
    statistics, not the real buffers. Puts the real buffers back on exit, also on error."""
    names = NORM_STATISTICS
    saved = []
    for m in norms:
        if not (m.training and m.track_running_stats):
            continue
        real = {n: getattr(m, n) for n in names if getattr(m, n, None) is not None}
        saved.append((m, real))
        for n, buf in real.items():
            setattr(m, n, buf.clone())
    try:
        yield
    finally:
        for m, real in saved:
            for n, buf in real.items():
                setattr(m, n, buf)
