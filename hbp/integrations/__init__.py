"""hbp.integrations: thin adapters over graph + planner + runtime (`torch.HCModule`; the JAX
counterpart lives in `hbp.jax`). `HCModule` loads on first use."""

from __future__ import annotations

__all__ = ["HCModule"]


def __getattr__(name: str):
    if name == "HCModule":
        from hbp.integrations.torch import HCModule

        return HCModule
    raise AttributeError(f"module 'hbp.integrations' has no attribute {name!r}")
