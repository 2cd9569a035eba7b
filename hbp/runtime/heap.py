"""Handing the heap that planning freed back to the OS (NOTE [ Planning's freed heap ])."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

__all__ = ["return_freed_heap"]

# NOTE [ Planning's freed heap ]
# Planning allocates many small Python objects (the DP's tables) and frees them before the
# step runs; compiling the one program called as is (JAX) does the same in XLA. glibc keeps freed
# small chunks in its heap, and a heap cannot shrink below its highest live chunk, so without
# help the process keeps that memory resident while the step runs on top of it: the first
# step's process peak is the planner's and the compiler's leftovers plus the step's. After
# collecting cycles, `malloc_trim(0)` hands free pages anywhere in the heap back to the OS
# (madvise), so the first step starts from what is really live. Both happen once per input
# signature (HCModule and hbp.jax), and so does this; elsewhere than glibc it does nothing.


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim(0)`; a no-op elsewhere):
    NOTE [ Planning's freed heap ]."""
    if not sys.platform.startswith("linux"):
        return
    gc.collect()  # the planner's garbage in reference cycles first
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
