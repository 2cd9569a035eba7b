"""The grad and autocast modes a captured op runs in (shared by the trace stages and the
executor): a node traced inside `with torch.no_grad():` or `with torch.autocast(...):` of the
forward records its modes in its meta, and the executor re-enters them around it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["MODES", "ambient_modes", "enter_modes", "exit_modes", "modes_closed_after"]

#: fx node meta key: the (grad, autocast) modes a node ran with in the traced forward, where
#: they differ from the modes of the call (`with torch.no_grad():`, `with torch.autocast(...)`
#: inside the forward: fx records the ops, not the context managers around them).
MODES = "hbp_modes"


def ambient_modes() -> tuple:
    """(grad enabled, (CPU autocast enabled, dtype), (CUDA autocast enabled, dtype))."""
    autocast = (
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (torch.is_grad_enabled(), *autocast)


class _Modes(contextlib.ExitStack):
    """The stack `enter_modes` returns: closed (or left as a context manager), it is no
    longer open (`_open`)."""

    def close(self) -> None:
        _forget(self)
        super().close()

    def __exit__(self, *exc) -> bool:
        _forget(self)
        return super().__exit__(*exc)


def enter_modes(modes: tuple) -> contextlib.ExitStack:
    """Switch to `modes` (an `ambient_modes()` value); the returned stack's close() undoes it
    (`exit_modes`, or `modes_closed_after` where the code between is cut short)."""
    grad, *autocast = modes
    stack = _Modes()
    stack.enter_context(torch.set_grad_enabled(grad))
    for device, state in zip(("cpu", "cuda"), autocast):
        if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) != state:
            stack.enter_context(torch.autocast(device, dtype=state[1], enabled=state[0]))
    _open().append(stack)
    return stack


def exit_modes(stack: contextlib.ExitStack) -> None:
    stack.close()


@contextlib.contextmanager
def modes_closed_after() -> Iterator[None]:
    """Close, on the way out, every mode `enter_modes` switched to inside and left open
    (NOTE [ Modes left open by an early stop ])."""
    opened = _open()
    depth = len(opened)
    try:
        yield
    finally:
        while len(opened) > depth:
            opened.pop().close()


# NOTE [ Modes left open by an early stop ]
# The generated code of a segment brackets a node traced inside the forward's own
# `torch.autocast(...)` (or `no_grad`) with `enter_modes` and `exit_modes`. A checkpoint's
# recompute stops early, by an exception out of the op that saves the last value backward
# needs, and that op can sit between the two: the autocast context was entered and never left.
# Autocast counts its nesting and clears its cache of low-precision weight copies only when
# the count returns to 0, so each early stop left it one higher (a model with autocast inside
# its forward: 8 per step), the cache was never cleared again, and the next autocast region
# in the process, whoever ran it, reused stale bf16 copies of weights the optimizer had since
# changed: an accelerate bf16 model trained after it stepped as if its weights had not moved
# (losses 4.835 and 4.797 for 4.706 and 4.578). The segment's call closes what its code left
# open (`modes_closed_after`).

_THREAD = threading.local()


def _open() -> list:
    """The stacks `enter_modes` opened on this thread and nothing has closed yet."""
    opened = getattr(_THREAD, "opened", None)
    if opened is None:
        opened = _THREAD.opened = []
    return opened


def _forget(stack: contextlib.ExitStack) -> None:
    opened = _open()
    for i in range(len(opened) - 1, -1, -1):  # the last, as a rule
        if opened[i] is stack:
            del opened[i]
            return
