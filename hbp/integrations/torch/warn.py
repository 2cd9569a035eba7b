"""Warnings at the caller's line: the first frame outside hbp and torch, whichever of
HCModule's paths led there (a call of `hc`, of an enabled model's forward, of
`torch.compile`'s frame, the end of a backward)."""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn_at_caller"]


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the first caller outside hbp and
    torch (a fixed `stacklevel` is right for one path only: an enabled model's forward, Dynamo's
    frame and nn.Module's call wrappers put different numbers of frames in between)."""
    frame, level = sys._getframe(1), 2  # level 2: the caller of this function
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "hbp" or name.startswith(("hbp.", "torch.")) or name == "torch"):
            break
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
