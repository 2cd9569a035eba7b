"""The grad and autocast modes a captured op runs in (shared by the trace stages and the
executor): a node traced inside `with torch.no_grad():` or `with torch.autocast(...):` of the
forward records its modes in its meta, and the executor re-enters them around it."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["MODES", "ambient_modes", "enter_modes", "exit_modes"]

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


def enter_modes(modes: tuple) -> contextlib.ExitStack:
    """Switch to `modes` (an `ambient_modes()` value); the returned stack's close() undoes it."""
    grad, *autocast = modes
    stack = contextlib.ExitStack()
    stack.enter_context(torch.set_grad_enabled(grad))
    for device, state in zip(("cpu", "cuda"), autocast):
        if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) != state:
            stack.enter_context(torch.autocast(device, dtype=state[1], enabled=state[0]))
    return stack


def exit_modes(stack: contextlib.ExitStack) -> None:
    stack.close()
