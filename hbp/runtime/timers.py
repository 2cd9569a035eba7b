"""Wall-clock timing of steps (docs/architecture.md "Metrics": `step_time_s`), in seconds."""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class Timer:
    """Context manager measuring the wall time of its block with `time.perf_counter`.

    On a CUDA `device` the device is synchronized before the clock starts and before it stops,
    so the time covers the kernels the block launched. `elapsed` holds seconds after exit.

        with Timer(device) as t:
            step()
        t.elapsed
    """

    def __init__(self, device: str | torch.device | None = None):
        self.cuda = _is_cuda(device) and torch.cuda.is_available()
        self.device = device
        self.elapsed: float = math.nan
        self._start = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Timer:
        self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.elapsed = time.perf_counter() - self._start


def summarize_times(times) -> dict[str, float]:
    """Summary of step times in seconds: median, p10, p90 (linear interpolation), mean,
    std (sample standard deviation, 0 for one sample) and n. NaNs (and n=0) when empty."""
    values = [float(t) for t in times]
    n = len(values)
    if n == 0:
        nan = math.nan
        return dict(median=nan, p10=nan, p90=nan, mean=nan, std=nan, n=0)
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return dict(
        median=float(p50),
        p10=float(p10),
        p90=float(p90),
        mean=statistics.fmean(values),
        std=statistics.stdev(values) if n > 1 else 0.0,
        n=n,
    )
