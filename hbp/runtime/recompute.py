"""Making recomputation invisible: what a recomputed forward must not do twice.

Recomputing a segment in backward runs its forward again. Dropout must draw the same masks
(torch.utils.checkpoint replays the RNG state: `preserve_rng_state=True`), and normalisation
layers that track running statistics (BatchNorm, SyncBatchNorm, InstanceNorm with
`track_running_stats=True`) must not update them a second time (pytorch#96136): in training
mode their output depends only on the batch statistics, so during the recompute each such
layer's statistic buffers (running_mean, running_var, num_batches_tracked) are swapped for
throw-away copies: the output is bit-identical, the real buffers are untouched, and the op
saves the same number of tensors as in the original forward (turning `track_running_stats`
off instead would change that count, and non-reentrant checkpoint matches saved tensors by
position).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hbp.graph.torch.running_stats import frozen_running_stats, stat_tracking_norms

__all__ = [
    "ReenterableContext",
    "autocast_cache_disabled",
    "checkpoint_context_fn",
    "frozen_running_stats",
    "buffer_owners",
    "buffers_kept",
    "getattr_path",
    "stacked",
    "stat_tracking_norms",
    "throwaway_attrs",
]


class ReenterableContext:
    """A context manager that can be entered again after (or while) it is active: each
    `__enter__` enters a fresh `make()`. Non-reentrant checkpoint calls `context_fn` once per
    forward and enters the recompute context once per recompute: more than once when the
    graph is backpropagated again (`retain_graph=True`, `torch.autograd.grad` then
    `.backward()`), which a `@contextlib.contextmanager` object cannot do."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make = make
        self._active: list[contextlib.AbstractContextManager] = []

    def __enter__(self):
        context = self.make()
        value = context.__enter__()
        self._active.append(context)
        return value

    def __exit__(self, *exc_info):
        return self._active.pop().__exit__(*exc_info)


def checkpoint_context_fn(module: nn.Module):
    """A `context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`:
    the original forward runs as is, the recompute runs with `module`'s norm layers frozen
    (every time it runs: see `ReenterableContext`)."""
    norms = stat_tracking_norms(module)

    def context_fn():
        return contextlib.nullcontext(), ReenterableContext(lambda: frozen_running_stats(norms))

    return context_fn


@contextlib.contextmanager
def autocast_cache_disabled() -> Iterator[None]:
    """Inside (and in the recompute of checkpoints started inside, which records the
    setting): autocast does not cache the low-precision copies of weights. The cache would
    keep the copy of every weight a segment casts alive until autocast exits (its recompute,
    in backward: a recompute holds all its weights' copies at once), where the IR, like
    autograd, keeps a copy only while its op saves it. The whole executed forward runs so,
    plain blocks too: where the caller's backward runs inside its autocast region, their
    cached copies stayed alive through the whole backward, past their ops' backwards (a
    diffusion transformer at "min" under CPU bf16 went over its budget). Same values: a cast
    is a cast."""
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


@contextlib.contextmanager
def stacked(*contexts) -> Iterator[None]:
    """Inside every one of `contexts`, entered in order (and left in reverse)."""
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


@contextlib.contextmanager
def throwaway_attrs(
    pairs: list[tuple[nn.Module, str]], values: list[torch.Tensor] | None = None
) -> Iterator[None]:
    """Inside: each (module, name) buffer is a copy (of `values[i]` where given: what it held
    before the original forward, NOTE [ Buffers a recomputed forward writes ]); the real one
    is put back on exit."""
    real = [(m, name, getattr(m, name)) for m, name in pairs]
    for k, (m, name, buf) in enumerate(real):
        setattr(m, name, (buf if values is None else values[k]).clone())
    try:
        yield
    finally:
        for m, name, buf in real:
            setattr(m, name, buf)


@contextlib.contextmanager
def buffers_kept(pairs: list[tuple[nn.Module, str]], out: list[torch.Tensor]) -> Iterator[None]:
    """On entry, copies of the (module, name) buffers are put in `out` (NOTE [ Buffers a
    recomputed forward writes ])."""
    out[:] = [getattr(m, name).detach().clone() for m, name in pairs]
    yield


# NOTE [ Buffers a recomputed forward writes ]
# A forward can update buffers in place that are not a norm's statistics: spectral_norm's power
# iteration writes its `_u` and `_v` each training call, and reads them to scale the weight.
# A recompute must neither write the real buffers a second time nor read their updated values:
# it runs on copies of what they held when the original forward started (kept by the
# checkpoint's forward context, per call), so it computes what the forward did, and the
# buffers end the step updated once, as without hbp. The captures record which buffers each
# node writes (`CapturedGraph.mutated_attrs`: op level from each op's run, module level from
# each child call's, on fake copies). A node that writes buffers is not pinned
# either (NOTE [ Running pinned values ]): its op cached then written in place by a later op of
# the same call (`F.normalize(..., out=)` clamps its norm in place) made torch's selective
# checkpoint raise "Tensor cached during selective activation checkpoint has been mutated".
# Nor is any node whose call writes into a tensor it made itself (`OpProfile.
# writes_own_intermediates`, seen op by op when the capture profiles it), whatever it writes.


def getattr_path(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def buffer_owners(root: Any, targets) -> list[tuple[Any, str]]:
    """(owner module, attribute name) of each dotted buffer path in `targets`, under `root`
    (what `throwaway_attrs` swaps)."""
    pairs = []
    for target in targets:
        owner_path, _, attr = target.rpartition(".")
        pairs.append((getattr_path(root, owner_path) if owner_path else root, attr))
    return pairs
