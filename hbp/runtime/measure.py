"""One training step measured the way docs/architecture.md "Metrics" defines it.

`measure_step(step_fn, params=...)` runs `warmup` untimed steps, then `repeats` timed steps
with nothing attached (wall time: median, p10, p90), then the measured steps:

1. The allocator step, with no dispatch mode at all (a dispatch mode changes what autograd
   allocates, see hbp/runtime/tracker.py): `peak_bytes`, the allocator's peak above the level
   before the step (`hbp.allocator.allocator_peak`: CUDA's `max_memory_allocated`; on
   CPU the allocator's own events, recorded by the profiler for this one step only).
2. The instrumented step, under `TotalFlopCounterMode` (FlopCounterMode's totals without its
   module hooks, which keep checkpoint-recomputed tensors alive) stacked with the exact
   `MemoryTracker` (innermost, so it sees exactly the ops it sees alone; neither mode
   allocates or holds tensors): `flops`, `tensor_peak_bytes` (live tensor storages) and the
   per-op timeline. `scratch_bytes` = `peak_bytes` - `tensor_peak_bytes`: kernel workspace
   (and allocator rounding on CUDA) that no tensor accounts for.

Before every step each parameter's `.grad` is set to None, so every step starts from the
same state and the measured peak includes the parameter gradients.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hbp.allocator import allocator_peak
from hbp.errors import ConfigError
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.timers import Timer, summarize_times
from hbp.runtime.tracker import MemoryTracker, measure_callable_peak

if TYPE_CHECKING:  # pandas only types the timeline: importing hbp.runtime need not load it
    import pandas as pd

__all__ = ["StepMeasurement", "measure_step", "measure_callable_peak"]


@dataclass
class StepMeasurement:
    """What `measure_step` measured. Bytes, FLOPs, seconds.

    peak_bytes: the most bytes the allocator held during the measured step above the level
        before it, parameter gradients and kernel workspace included (None when
        `track_memory=False`).
    tensor_peak_bytes: the live-storage tracker's peak (tensors only; None without it).
    scratch_bytes: peak_bytes - tensor_peak_bytes (kernel workspace; None without both).
    flops: FLOPs of the measured step (None when `count_flops=False`).
    step_time_s, step_time_p10, step_time_p90: median and spread of the timed steps
        (NaN when `repeats=0`); step_times: every timed step, in order.
    timeline: the tracker's per-op memory timeline (op_index, live_bytes, phase, op) or None.
    peak_by_phase: phase -> peak live bytes counted by the tracker ({} without it).
    device: the device the step ran on, e.g. "cpu" or "cuda:0".
    last_output: the measured step's return value, tensors detached.
    """

    peak_bytes: int | None
    flops: int | None
    step_time_s: float
    step_time_p10: float
    step_time_p90: float
    step_times: list[float]
    timeline: pd.DataFrame | None
    peak_by_phase: dict[str, int]
    device: str
    last_output: object = None
    tensor_peak_bytes: int | None = None
    time_summary: dict[str, float] = field(default_factory=dict)

    @property
    def scratch_bytes(self) -> int | None:
        if self.peak_bytes is None or self.tensor_peak_bytes is None:
            return None
        return self.peak_bytes - self.tensor_peak_bytes


def _param_list(params) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        params = [params]
    accepted = "an nn.Module, a tensor, an iterable of tensors or None"
    if not isinstance(params, Iterable) or isinstance(params, (str, bytes)):
        raise ConfigError("params", params, accepted)
    unique = {id(p): p for p in params}
    if not all(isinstance(p, torch.Tensor) for p in unique.values()):
        raise ConfigError("params", params, accepted)
    return list(unique.values())


def _infer_device(params: list[torch.Tensor], device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if params:
        return params[0].device
    return torch.device("cpu")


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, value, "an integer >= 0")
    return value


def step_peak(step_fn, device, *, cpu: str = "allocator") -> tuple[object, int]:
    """Run `step_fn()` once; return (output, peak bytes above the level before it).

    The allocator's peak (`allocator_peak`: what `measure_step` reports as `peak_bytes`), or
    on CPU with `cpu="tracker"` the live-storage tracker's (tensors only)."""
    dev = torch.device(device)
    if dev.type == "cpu" and cpu == "tracker":
        return measure_callable_peak(step_fn)
    gc.collect()
    return allocator_peak(step_fn, device=dev)


def _instrumented_step(step_fn, tracker, flop_counter):
    """Run one step under the flop counter (outer) and the tracker (inner), either optional."""
    gc.collect()
    with contextlib.ExitStack() as stack:
        if flop_counter is not None:
            stack.enter_context(flop_counter)
        if tracker is not None:
            stack.enter_context(tracker)
        return step_fn()


def _detached(output):
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, output)


def measure_step(
    step_fn: Callable[[], object],
    *,
    params=None,
    warmup: int = 1,
    repeats: int = 3,
    device: str | torch.device | None = None,
    track_memory: bool = True,
    count_flops: bool = True,
    record_timeline: bool = True,
    track_tensors: bool = True,
) -> StepMeasurement:
    """Measure one training step `step_fn()` (forward + loss + backward [+ optimizer]).

    Args:
        step_fn: runs one step, takes no arguments; its return value (e.g. the loss) is
            kept, detached, as `last_output` of the measured step.
        params: the parameters whose `.grad` is set to None before every step (an
            `nn.Module`, an iterable of tensors, or None).
        warmup: untimed steps first. repeats: timed steps (no tracker attached).
        device: where the step runs; inferred from `params` (else CPU) when None.
        track_memory: measure `peak_bytes` (the allocator step).
        count_flops: count the measured step's FLOPs (TotalFlopCounterMode).
        record_timeline: keep the tracker's per-op timeline.
        track_tensors: count `tensor_peak_bytes` with the live-storage tracker (False for
            compiled code, whose buffers no dispatch mode sees).

    Steps run: warmup + repeats + 1 (allocator) + 1 (instrumented: when FLOPs or tensors are
    counted).
    """
    if not callable(step_fn):
        raise ConfigError("step_fn", step_fn, "a callable taking no arguments")
    warmup = _check_count("warmup", warmup)
    repeats = _check_count("repeats", repeats)
    param_list = _param_list(params)
    dev = _infer_device(param_list, device)

    def reset_grads() -> None:
        for p in param_list:
            p.grad = None

    for _ in range(warmup):
        reset_grads()
        step_fn()

    step_times = []
    for _ in range(repeats):
        reset_grads()
        with Timer(dev) as timer:
            step_fn()
        step_times.append(timer.elapsed)
    times = summarize_times(step_times)

    output = peak_bytes = None
    if track_memory:
        reset_grads()
        output, peak_bytes = step_peak(step_fn, dev)
    tracker = None
    if track_memory and track_tensors:
        tracker = MemoryTracker(record_timeline=record_timeline)
    flop_counter = TotalFlopCounterMode() if count_flops else None
    if tracker is not None or flop_counter is not None or not track_memory:
        reset_grads()
        instrumented_output = _instrumented_step(step_fn, tracker, flop_counter)
        if not track_memory:
            output = instrumented_output

    return StepMeasurement(
        peak_bytes=peak_bytes,
        flops=int(flop_counter.get_total_flops()) if flop_counter is not None else None,
        step_time_s=times["median"],
        step_time_p10=times["p10"],
        step_time_p90=times["p90"],
        step_times=step_times,
        timeline=tracker.timeline_frame() if tracker is not None and record_timeline else None,
        peak_by_phase=dict(tracker.peak_by_phase) if tracker is not None else {},
        device=str(dev),
        last_output=_detached(output),
        tensor_peak_bytes=tracker.peak_bytes if tracker is not None else None,
        time_summary=times,
    )
