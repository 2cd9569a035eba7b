"""hbp.runtime: executes plans on torch models and measures steps (memory, FLOPs, time).

Measurement API (docs/architecture.md "Metrics"): `MemoryTracker` (exact live-storage bytes on CPU),
`count_flops`, `Timer` / `summarize_times`, and `measure_step` (one training step: peak bytes,
FLOPs, median step time).
"""

from __future__ import annotations

import importlib

# Submodules load on first use: HCModule users import the executor, not pandas/timers.
_LAZY = {
    "MemoryTracker": "hbp.runtime.tracker",
    "StepMeasurement": "hbp.runtime.measure",
    "Timer": "hbp.runtime.timers",
    "allocator_peak": "hbp.allocator",
    "count_flops": "hbp.runtime.flops",
    "count_flops_breakdown": "hbp.runtime.flops",
    "flop_breakdown_frame": "hbp.runtime.flops",
    "measure_callable_peak": "hbp.runtime.tracker",
    "measure_step": "hbp.runtime.measure",
    "phase": "hbp.runtime.tracker",
    "summarize_times": "hbp.runtime.timers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hbp.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
