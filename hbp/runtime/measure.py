"""One training step measured the way DESIGN.md "Metrics" defines it.

`measure_step(step_fn, params=...)` runs `warmup` untimed steps, then `repeats` timed steps
with nothing attached (wall time: median, p10, p90), then the measured step(s):

- CPU: one step under `TotalFlopCounterMode` (FlopCounterMode's totals without its module
  hooks, which keep checkpoint-recomputed tensors alive) stacked with the exact
  `MemoryTracker`. The tracker is the innermost mode, so it sees exactly the ops it sees
  alone; neither mode allocates or holds tensors, so neither number is perturbed.
- CUDA: one step with no dispatch mode at all, measured by the caching allocator
  (`max_memory_allocated` minus the level before the step; a dispatch mode would change what
  autograd allocates, see hbp/runtime/tracker.py), then, if FLOPs or a timeline are asked
  for, one more step under the flop counter and the tracker.

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

from hbp.errors import ConfigError
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.timers import Timer, summarize_times
from hbp.runtime.tracker import MemoryTracker, allocator_peak, measure_callable_peak

if TYPE_CHECKING:  # pandas only types the timeline: importing hbp.runtime need not load it
    import pandas as pd

__all__ = ["StepMeasurement", "measure_step", "measure_callable_peak"]


@dataclass
class StepMeasurement:
    """What `measure_step` measured. Bytes, FLOPs, seconds.

    peak_bytes: most bytes alive during the measured step above the level before it,
        parameter gradients included (None when `track_memory=False`).
    flops: FLOPs of the measured step (None when `count_flops=False`).
    step_time_s, step_time_p10, step_time_p90: median and spread of the timed steps
        (NaN when `repeats=0`); step_times: every timed step, in order.
    timeline: the tracker's per-op memory timeline (op_index, live_bytes, phase, op) or None.
    peak_by_phase: phase -> peak live bytes counted by the tracker ({} without it).
    tracker_peak_bytes: the tracker's own peak (equals peak_bytes on CPU; on CUDA a
        cross-check of the allocator number, which also counts allocator rounding to 512
        bytes and kernel workspace).
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
    tracker_peak_bytes: int | None = None
    time_summary: dict[str, float] = field(default_factory=dict)


def _param_list(params) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        params = [params]
    if not isinstance(params, Iterable):
        raise ConfigError("params", params, "an nn.Module, an iterable of tensors or None")
    unique = {id(p): p for p in params}
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


def step_peak(step_fn, device, *, cpu: str = "tracker") -> tuple[object, int]:
    """Run `step_fn()` once; return (output, peak bytes above the level before it).

    CUDA: the allocator's max_memory_allocated. CPU: the exact tracker (`cpu="tracker"`,
    what `measure_step` uses) or the allocator's profiler events (`cpu="allocator"`, for
    compiled code whose buffers no dispatch mode can see)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return _cuda_allocator_step(step_fn, dev)
    if cpu == "allocator":
        return allocator_peak(step_fn)
    return measure_callable_peak(step_fn)


def _cuda_allocator_step(step_fn, dev: torch.device) -> tuple[object, int]:
    """Run one step with no dispatch mode; return (output, allocator peak bytes above the
    level before the step)."""
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    output = step_fn()
    torch.cuda.synchronize(dev)
    return output, int(torch.cuda.max_memory_allocated(dev) - base)


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
) -> StepMeasurement:
    """Measure one training step `step_fn()` (forward + loss + backward [+ optimizer]).

    Args:
        step_fn: runs one step, takes no arguments; its return value (e.g. the loss) is
            kept, detached, as `last_output` of the measured step.
        params: the parameters whose `.grad` is set to None before every step (an
            `nn.Module`, an iterable of tensors, or None).
        warmup: untimed steps first. repeats: timed steps (no tracker attached).
        device: where the step runs; inferred from `params` (else CPU) when None.
        track_memory: measure peak bytes (CPU: MemoryTracker; CUDA: allocator stats).
        count_flops: count the measured step's FLOPs (TotalFlopCounterMode).
        record_timeline: keep the tracker's per-op timeline (on CUDA: in an extra step).

    Steps run: warmup + repeats + 1 (+ 1 on CUDA when FLOPs or a timeline are asked for).
    """
    if not callable(step_fn):
        raise ConfigError("step_fn", step_fn, "a callable taking no arguments")
    warmup = _check_count("warmup", warmup)
    repeats = _check_count("repeats", repeats)
    param_list = _param_list(params)
    dev = _infer_device(param_list, device)
    cuda = dev.type == "cuda"

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
    allocator_measured = cuda and track_memory
    if allocator_measured:
        reset_grads()
        output, peak_bytes = _cuda_allocator_step(step_fn, dev)
    tracker = None
    if track_memory and (not cuda or record_timeline):
        tracker = MemoryTracker(record_timeline=record_timeline)
    flop_counter = TotalFlopCounterMode() if count_flops else None
    if tracker is not None or flop_counter is not None or not allocator_measured:
        reset_grads()
        instrumented_output = _instrumented_step(step_fn, tracker, flop_counter)
        if not allocator_measured:
            output = instrumented_output
            peak_bytes = tracker.peak_bytes if tracker is not None else None

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
        tracker_peak_bytes=tracker.peak_bytes if tracker is not None else None,
        time_summary=times,
    )
