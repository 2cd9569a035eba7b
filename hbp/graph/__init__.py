"""hbp.graph: the framework-neutral IR (`Graph`, `Node`) and the captures that fill it.

Importing this package does not import torch or jax: `capture` (torch.fx, see
`hbp.graph.torch.capture`) loads on first use, so the planner stays framework-free.
"""

from __future__ import annotations

from hbp.graph.ir import Graph, Node

__all__ = ["CapturedGraph", "Graph", "Node", "capture"]


def __getattr__(name: str):
    if name in ("capture", "CapturedGraph"):
        from hbp.graph.torch import capture as capture_stage

        return getattr(capture_stage, name)
    raise AttributeError(f"module 'hbp.graph' has no attribute {name!r}")
