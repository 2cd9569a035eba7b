"""Pinned values of recomputed segments, run with torch's selective-checkpoint contexts (NOTE
[ Running pinned values ]): the mark the generated code sets around a pinned node, the policy
that saves its outputs, and the frames that let nested pinning segments store their pins in
their parent's recompute pass."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_CachedMode = torch_checkpoint._CachedTorchDispatchMode
#: torch's key of an op's entries in a selective-checkpoint storage (the op itself before it
#: keyed compiled regions apart)
_storage_key = getattr(torch_checkpoint, "_sac_storage_key", lambda func, args: func)

_PINNING = threading.local()  # .segment: the key of the segment whose pin runs now
_PARENTS = threading.local()  # .stack: the PinParent frames running now, innermost last


# NOTE [ Running pinned values ]
# A recomputed segment that pins nodes (`Segment.pinned`, NOTE [ Pinned values ] in
# hbp/analysis/simulate.py) runs its checkpoint with `create_selective_checkpoint_contexts`:
# the caching mode asks a policy for every op the forward dispatches, and stores the outputs of
# those it answers MUST_SAVE; the recompute's cached mode answers the same ops, counted per op
# overload in dispatch order, from that storage. The generated code marks the pinned fx node
# while it runs (`pin_begin(key)` / `pin_end()` around it, key = (start, stop, depth) of the
# pinning segment, in the forward and in every recompute: plain Python, no dispatched op, so
# the counts match), and the segment's policy (`pin_policy`) answers MUST_SAVE only for ops
# dispatched under its own mark (nested checkpoints and other segments' pins dispatch under the
# same mode stack) and whose outputs share no storage with their inputs (views, in-place
# results: storing them would keep the input's storage, not the node's). A recompute's early
# stop raises inside a node, between `pin_begin` and `pin_end`: every recompute context (and
# a pinning forward) restores the mark on exit (`pin_mark`), else the next forward would pin
# every op. The storage is made per checkpoint call (context_fn); torch's cached mode frees
# each entry as its recompute reads it, and a second backward of a retained graph found it
# consumed (NOTE [ Pinned values and a second backward ]). A pin on a value some node later
# mutates in place (through any view) is dropped: torch refuses a stored tensor whose version
# changed, and recomputing it is always exact. Compiled segments (NOTE [ Compiled segments ])
# run without pins: their ops reach the dispatch modes as one compiled region; the plan then
# keeps less and recomputes more than it predicts.
# Nested pinning segments. Torch recomputes a nested segment C with the frame its checkpoint
# made in the original forward (its saved tensors are packed there), while its parent P's
# recompute pass calls C's checkpoint again, making a new frame whose saves nobody reads. So
# a top-level segment stores its pins in the forward, but a nested one must store them in the
# parent's pass and have them answered by the original frame: the parent's checkpoint calls
# push a `PinParent` frame while their forward and their recompute run (`parent_frame`);
# C's call in P's forward stores nothing (policy `_save_nothing`: every op is marked
# "recompute") and registers its cached mode with P's frame; C's call in P's recompute pass
# finds it and its caching mode writes into that same storage (`nested_pin_contexts`),
# overwriting the pinned ops' entries with their values. Calls of C in an ancestor's pass
# (under a P frame made there) store nothing. A pass of P that stops before C runs leaves the
# storage as the forward made it: C's pass recomputes everything.


# NOTE [ Pinned values and a second backward ]
# A backward that keeps its graph (`retain_graph=True`, or `autograd.grad(...,
# create_graph=True)`: a gradient penalty's first pass) can be followed by another one through
# the same forward, whose recomputes read the pinned values again; torch's cached mode had
# freed each as the first recompute read it, and raised "Trying to backward an extra time"
# (a Gemma's gradient penalty at any budget that recomputes; a new-user trial). The cached
# mode of a pinning checkpoint (`pin_contexts`) keeps an entry where the backward reading
# it keeps its graph (`torch._C._autograd._get_current_graph_task_keep_graph()`), as autograd
# keeps a saved tensor then: it lives with the retained graph, and the last backward frees it
# as before.


class _CachedAcrossBackwards(_CachedMode):
    """torch's cached mode, keeping each entry it answers while the backward keeps its graph
    (NOTE [ Pinned values and a second backward ])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            return super().__torch_dispatch__(func, types, args, kwargs)
        key = _storage_key(func, args)
        idx = self.func_counter.get(key, 0)
        entries = self.storage.get(key)
        entry = entries.get(idx) if isinstance(entries, dict) else None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if entry is not None and entries.get(idx) is not entry:  # consumed: kept
            entries[idx] = entry
        return out


def pin_contexts(policy) -> tuple:
    """`create_selective_checkpoint_contexts(policy)`, its cached mode keeping its entries
    for another backward through a retained graph (NOTE [ Pinned values and a second
    backward ])."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    if type(cached) is _CachedMode:
        cached.__class__ = _CachedAcrossBackwards
    return caching, cached


def pin_begin(segment: tuple[int, int, int]) -> None:
    _PINNING.segment = segment


def pin_end() -> None:
    _PINNING.segment = None


@contextlib.contextmanager
def pin_mark() -> Iterator[None]:
    """Restore the pinning mark on exit, also when an early stop raised inside a pinned node."""
    before = getattr(_PINNING, "segment", None)
    try:
        yield
    finally:
        _PINNING.segment = before


def pin_policy(segment: tuple[int, int, int]) -> Callable:
    """The selective-checkpoint policy of the pinning segment with key `segment`."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if getattr(_PINNING, "segment", None) != segment:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if _returns_an_alias(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        output = getattr(ctx, "op_output", None)  # NOTE [ Pins before the op has run ]
        if output is None:
            return CheckpointPolicy.MUST_SAVE
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


# NOTE [ Pins before the op has run ]
# Torch 2.13 asks the policy after the op ran (`ctx.op_output`), so that an output sharing a
# storage with an input (a view, an in-place result) is told apart by its storage. Older
# torch (2.11, the lent GPU machines' build) asks before the op runs and has no `op_output`.
# The op's schema says the same for every op that declares its aliasing (its returns carry
# alias annotations: views, in-place and out= overloads), and it is read first on every
# version; the storage check then only adds the undeclared cases where the output is known.


def _returns_an_alias(op) -> bool:
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _save_nothing(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class PinParent:
    """One checkpoint call of a segment with pinning children: their key -> (a weak reference
    to) the cached mode of the child's checkpoint made in this call's forward."""

    def __init__(self):
        self.children: dict[tuple[int, int, int], weakref.ref] = {}


@contextlib.contextmanager
def parent_frame(frame: PinParent | None, recompute: bool) -> Iterator[None]:
    """While a pinning child's parent runs (its forward, or its recompute pass: `recompute`),
    the child's checkpoint calls find the parent's frame here."""
    if frame is None:
        yield
        return
    if not hasattr(_PARENTS, "stack"):
        _PARENTS.stack = []
    _PARENTS.stack.append((frame, recompute))
    try:
        yield
    finally:
        _PARENTS.stack.pop()


def nested_pin_contexts(key: tuple[int, int, int]) -> tuple:
    """The selective-checkpoint contexts of a nested pinning segment's checkpoint call.

    Called in its parent's forward (the original one, or inside a recompute pass of an
    ancestor): stores nothing, and registers its cached mode with the parent's frame. Called in
    its parent's recompute pass: stores the pins into the storage of the call made in that
    parent frame's forward, whose cached mode answers them in the segment's own recompute pass
    (if that call's frame is gone, the segment saves nothing: nothing is stored)."""
    frame, recompute = _PARENTS.stack[-1]
    if not recompute:
        caching, cached = pin_contexts(_save_nothing)
        frame.children[key] = weakref.ref(cached)
        return caching, cached
    ref = frame.children.get(key)
    target = ref() if ref is not None else None
    if target is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    caching, _ = create_selective_checkpoint_contexts(pin_policy(key))
    if not hasattr(caching, "storage") or not hasattr(target, "storage"):
        raise RuntimeError(  # pragma: no cover - torch internals changed
            "hbp: torch's selective-checkpoint modes no longer keep a `storage` attribute; "
            "nested pinned segments cannot run (plan with pins only at the top level)"
        )
    caching.storage = target.storage  # this pass's values go to the frame that answers them
    return caching, contextlib.nullcontext()
