"""One training step measured for the gpu check: `hbp.measure_step` (docs/architecture.md "Metrics")
plus the allocator's reserved memory on CUDA and the gradients the step left.

    measured = measure(step, params, "cuda", timed_steps=5)
    row.update(measured.fields())
    row["grad_diff"] = grad_diff(measured.grads, reference.grads)

Order: `WARMUP_STEPS` untimed steps (hbp captures, calibrates and plans in the first; its wall
time, the device synchronized after it, is `first_step_s`), then
the device's cache is emptied and its peak statistics reset, then `hbp.measure_step`:
`timed_steps` timed steps (median wall time, the device synchronized around each), one step
under the allocator alone (`peak_bytes`: CUDA's `max_memory_allocated` minus the level before
the step) and one under the FLOP counter (`torch.utils.flop_counter` through hbp's
`TotalFlopCounterMode`), whose gradients are the ones compared. `reserved_bytes` is
`max_memory_reserved` after all that minus `memory_reserved` before the timed steps: what the
caching allocator had to reserve beyond what it held.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import hbp

from .sizes import WARMUP_STEPS


@dataclass
class Measured:
    """Bytes, FLOPs, seconds of one step, and the parameters' gradients after it."""

    peak_bytes: int | None
    reserved_bytes: int | None
    flops: int | None
    step_time_s: float
    first_step_s: float
    grads: list[torch.Tensor | None]
    loss: float | None

    def fields(self) -> dict:
        """The JSON row's measured fields."""
        return {
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "flops": self.flops,
            "step_time_s": self.step_time_s,
            "first_step_s": self.first_step_s,
            "loss": self.loss,
        }


def measure(
    step: Callable[[], torch.Tensor],
    params: list[torch.Tensor],
    device: str,
    *,
    timed_steps: int,
    count_flops: bool = True,
) -> Measured:
    """Warm up, then measure `step` (forward, loss, backward; returns the loss) as the module
    docstring says. `params`: the tensors whose `.grad` is reset before every step and read
    after the last one."""
    cuda = device == "cuda"
    first_step_s = math.nan
    for index in range(WARMUP_STEPS):
        _reset(params)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if index == 0:
            first_step_s = time.perf_counter() - start
    reserved_before = None
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reserved_before = torch.cuda.memory_reserved()
    m = hbp.measure_step(
        step,
        params=params,
        warmup=0,
        repeats=timed_steps,
        device=device,
        count_flops=count_flops,
        record_timeline=False,
        track_tensors=False,
    )
    reserved = None
    if cuda:
        torch.cuda.synchronize()
        reserved = int(torch.cuda.max_memory_reserved() - reserved_before)
    loss = m.last_output
    return Measured(
        peak_bytes=m.peak_bytes,
        reserved_bytes=reserved,
        flops=m.flops,
        step_time_s=m.step_time_s,
        first_step_s=first_step_s,
        grads=[None if p.grad is None else p.grad.detach().clone() for p in params],
        loss=float(loss) if isinstance(loss, torch.Tensor) else None,
    )


def grad_diff(grads: list, reference: list) -> float:
    """The largest gradient difference against `reference`, parameter by parameter relative to
    that parameter's largest reference gradient: max_p max|g_p - r_p| / max|r_p| (absolute
    where r_p is all zeros). A gradient present on one side only is +inf; NaN never passes."""
    if len(grads) != len(reference):
        return math.inf
    worst = 0.0
    for g, r in zip(grads, reference):
        if g is None or r is None:
            if (g is None) != (r is None):
                return math.inf
            continue
        if g.shape != r.shape:
            return math.inf
        diff = (g.float() - r.float()).abs().max().item()
        scale = r.float().abs().max().item()
        value = diff / scale if scale > 0 else diff
        if math.isnan(value):
            return math.nan
        worst = max(worst, value)
    return worst


def release(device: str) -> None:
    """Free what the last variant left in the caching allocator (its peak starts afresh)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _reset(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
