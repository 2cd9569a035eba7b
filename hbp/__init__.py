"""hbp: height-compressed backprop.

Train with less activation memory: `hbp.enable(model, budget="50%act")` makes a model's
training step stay within a memory budget with the least recomputation, in place;
`hbp.HCModule(model, budget=...)` is the wrapper form; the JAX counterpart is
`hbp.jax.height_compressed_grad(fun, budget=...)`.

Public API (docs/architecture.md): enable, disable, engine_of, HCModule, Budget, BudgetError,
measure_step, estimate, ops.chunked_cross_entropy,
jax.height_compressed, jax.height_compressed_grad. Heavy submodules load on first use, so
`import hbp` stays cheap and does not import jax.
"""

from __future__ import annotations

import importlib

from hbp.errors import (
    BudgetError,
    BudgetWarning,
    CacheWarning,
    CaptureError,
    CaptureWarning,
    ConfigError,
)

__version__ = "0.1.0"

_LAZY = {
    "HCModule": ("hbp.integrations.torch", "HCModule"),
    "enable": ("hbp.integrations.torch", "enable"),
    "disable": ("hbp.integrations.torch", "disable"),
    "engine_of": ("hbp.integrations.torch", "engine_of"),
    "is_enabled": ("hbp.integrations.torch", "is_enabled"),
    "Budget": ("hbp.planner.budget", "Budget"),
    "measure_step": ("hbp.runtime.measure", "measure_step"),
    "estimate": ("hbp.estimate", "estimate"),
    "MemoryTracker": ("hbp.runtime.tracker", "MemoryTracker"),
    "plan": ("hbp.planner", "plan"),
    "simulate": ("hbp.analysis.simulate", "simulate"),
    "ops": ("hbp.ops", None),
    "jax": ("hbp.jax", None),
    "analysis": ("hbp.analysis", None),
    "workloads": ("hbp.workloads", None),
}

__all__ = [
    "BudgetError",
    "BudgetWarning",
    "CacheWarning",
    "CaptureError",
    "CaptureWarning",
    "ConfigError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hbp' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
