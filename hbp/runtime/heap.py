"""Handing the heap that planning freed back to the OS (NOTE [ Planning's freed heap ])."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import sys
from collections.abc import Iterator

__all__ = ["heap_returned_after"]

# NOTE [ Planning's freed heap ]
# Planning allocates many small Python objects (the DP's tables) and frees them before the
# step runs; compiling the one program called as is (JAX) does the same in XLA. glibc keeps freed
# small chunks in its heap, and a heap cannot shrink below its highest live chunk, so without
# help the process keeps that memory resident while the step runs on top of it: the first
# step's process peak is the planner's and the compiler's leftovers plus the step's. After
# collecting cycles, `malloc_trim(0)` hands free pages anywhere in the heap back to the OS
# (madvise), so the first step starts from what is really live. Both happen once per input
# signature (HCModule and hbp.jax), and so does this; elsewhere than glibc it does nothing.
#
# A full `gc.collect()` walks every object the process tracks: with transformers imported that
# is 0.25-0.5 s, paid again at every new signature and budget. The garbage to collect is what
# the block made, so the objects that were alive before it are frozen (`gc.freeze()`, a list
# splice) and the collection walks only the block's own; they are unfrozen after it. A caller
# that froze objects itself (a server before it forks) keeps them frozen: the block then
# neither freezes nor unfreezes, and its collection skips the caller's frozen objects as any
# collection does.


@contextlib.contextmanager
def heap_returned_after() -> Iterator[None]:
    """Run the block (a capture, a plan, a compile), then collect the reference cycles it
    left and give the C heap's free pages back to the OS (glibc `malloc_trim(0)`; elsewhere
    nothing): NOTE [ Planning's freed heap ]."""
    if not sys.platform.startswith("linux"):
        yield
        return
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        gc.collect()  # the block's garbage in reference cycles, before the trim
        if freeze:
            gc.unfreeze()
        _malloc_trim()


def _malloc_trim() -> None:
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _libc_malloc_trim():
    """glibc's `malloc_trim`, or None (musl has none); found once (`find_library` runs
    `ldconfig`)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
