"""Background samplers of process and GPU resources (docs/architecture.md "Metrics": `rss_peak_mb`,
`gpu_mem_peak_mb`, `gpu_util_pct`).

A sampler runs `sample()` on a daemon thread every `interval_s` seconds between `start()` and
`stop()` (or inside `with`), and once more at each end so that a block shorter than the
interval still has a reading. `results()` returns a flat dict for metrics.json. The GPU
sampler never raises: no GPU, no NVML library or any NVML error means it records nothing.
"""

from __future__ import annotations

import threading

import psutil

from hbp.units import MIB


class Sampler:
    """Calls `sample()` periodically on a daemon thread while active."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def results(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def _take(self) -> None:
        self.sample()
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def start(self) -> Sampler:
        self._take()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._take()

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RssSampler(Sampler):
    """Peak resident set size of this process (psutil), in bytes and MiB."""

    def __init__(self, interval_s: float = 0.02):
        super().__init__(interval_s)
        self._process = psutil.Process()
        self.peak_bytes = 0

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def results(self) -> dict:
        return {"rss_peak_mb": self.peak_bytes / MIB}


class GpuSampler(Sampler):
    """Peak used memory and utilisation of one GPU through NVML (pynvml, from nvidia-ml-py).

    `results()`: gpu_mem_peak_mb (device-wide used memory, all processes, MiB),
    gpu_util_pct (mean utilisation over the samples, %), gpu_util_peak_pct; empty when NVML is
    unavailable or failed at any point before the first sample.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.05):
        super().__init__(interval_s)
        self.device_index = device_index
        self._nvml = None
        self._handle = None
        self.mem_peak_bytes = 0
        self._util_sum = 0.0
        self._util_peak = 0.0
        self._util_count = 0

    def start(self) -> Sampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._find_handle(pynvml)
        except Exception:  # no library, no driver, no device: record nothing
            self._nvml = self._handle = None
            return self
        return super().start()

    def _find_handle(self, pynvml):
        """The NVML handle of torch's CUDA device `device_index` (matched by UUID, because NVML
        ignores CUDA_VISIBLE_DEVICES), falling back to the same index."""
        try:
            import torch

            uuid = str(torch.cuda.get_device_properties(self.device_index).uuid)
            return pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            )
        except Exception:
            return pynvml.nvmlDeviceGetHandleByIndex(self.device_index)

    def sample(self) -> None:
        if self._handle is None:
            return
        try:
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:
            return
        self.mem_peak_bytes = max(self.mem_peak_bytes, int(used))
        self._util_sum += util
        self._util_peak = max(self._util_peak, util)
        self._util_count += 1

    def stop(self) -> None:
        super().stop()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None

    def results(self) -> dict:
        if self._util_count == 0:
            return {}
        return {
            "gpu_mem_peak_mb": self.mem_peak_bytes / MIB,
            "gpu_util_pct": self._util_sum / self._util_count,
            "gpu_util_peak_pct": self._util_peak,
        }
