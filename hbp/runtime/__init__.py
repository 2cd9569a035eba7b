"""hbp.runtime: executes plans on torch models and measures steps (memory, FLOPs, time).

Measurement API (DESIGN.md "Metrics"): `MemoryTracker` (exact live-storage bytes on CPU),
`count_flops`, `Timer` / `summarize_times`, and `measure_step` (one training step: peak bytes,
FLOPs, median step time).
"""

from hbp.runtime.flops import count_flops, count_flops_breakdown, flop_breakdown_frame
from hbp.runtime.measure import StepMeasurement, measure_step
from hbp.runtime.timers import Timer, summarize_times
from hbp.runtime.tracker import MemoryTracker, allocator_peak, measure_callable_peak, phase

__all__ = [
    "MemoryTracker",
    "StepMeasurement",
    "Timer",
    "allocator_peak",
    "count_flops",
    "count_flops_breakdown",
    "flop_breakdown_frame",
    "measure_callable_peak",
    "measure_step",
    "phase",
    "summarize_times",
]
