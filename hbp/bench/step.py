"""Measuring the step: warm-up, timed steps and the measured step with the resource samplers
running (`measure_steps`), the checks against a plain-autograd copy (`reference_checks`:
gradients and naive FLOPs) and the optimizer step's time. The measurement itself is
`hbp.runtime.measure`'s (docs/architecture.md "Metrics"); this module only drives it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import pandas as pd
import psutil
import torch

from hbp.bench.config import build_workload, workload_overrides
from hbp.telemetry.samplers import GpuSampler, RssSampler
from hbp.telemetry.tables import TIMED_PHASE
from hbp.units import MIB

log = logging.getLogger("hbp.bench")

GRAD_TOLERANCE = 1e-4


class Progress:
    """Logs "step i/n (phase) x.xxx s" for long runs: a step slower than `every_s`, or the
    latest step once `every_s` seconds have passed since the last line. Quiet for fast runs."""

    def __init__(self, total: int, label: str, every_s: float = 5.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.done = 0
        self._last = time.perf_counter()

    def update(self, phase: str, step_time_s: float) -> None:
        self.done += 1
        now = time.perf_counter()
        if step_time_s >= self.every_s or now - self._last >= self.every_s:
            log.info(
                "%s: step %d/%d (%s) %.3f s", self.label, self.done, self.total, phase, step_time_s
            )
            self._last = now


def max_relative_grad_error(grads, ref_grads) -> float:
    """max over parameters of max|g - g_ref| / max|g_ref| (absolute error where g_ref is all
    zero); inf when one side has a gradient and the other does not."""
    if len(grads) != len(ref_grads):
        return math.inf
    worst = 0.0
    for g, r in zip(grads, ref_grads):
        if g is None and r is None:
            continue
        if g is None or r is None or g.shape != r.shape:
            return math.inf
        scale = r.abs().max().item()
        error = (g - r).abs().max().item()
        worst = max(worst, error / scale if scale > 0 else error)
    return worst


def _step(module, workload, batch, params, seed) -> torch.Tensor:
    """One step of `module` from `seed`, its gradients left in `.grad`; its loss."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = workload.step_loss(module, batch)
    loss.backward()
    return loss


def _step_gradients(module, workload, batch, params, seed):
    """One step of `module` from `seed`: (parameter gradients, cloned; loss)."""
    loss = _step(module, workload, batch, params, seed)
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    return grads, float(loss.detach())


def time_optimizer_step(params, device, repeats: int) -> float | None:
    """Median seconds of `repeats` AdamW steps over the parameters that have a gradient (the
    first step, which allocates the optimizer state, is not timed). None without gradients."""
    from hbp.runtime.timers import Timer

    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return None
    optimizer = torch.optim.AdamW(with_grad, lr=1e-4)
    optimizer.step()
    times = []
    for _ in range(repeats):
        with Timer(device) as timer:
            optimizer.step()
        times.append(timer.elapsed)
    return statistics.median(times)


def _gpu_sampler(device: torch.device):
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return GpuSampler(index)


def measure_steps(cfg, workload, module, batch, params, device, allocator: bool = False):
    """Warm-up, timed steps and the measured step (`measure_step`) with the resource samplers
    running. Returns (StepMeasurement, per-step DataFrame, sampler results).

    `allocator`: for compiled modes, which no dispatch mode can observe (their buffers are
    allocated outside the dispatcher): only the allocator's peak is measured (FLOPs and the
    tensor tracker are skipped)."""
    from hbp.runtime.measure import measure_step

    label = f"{cfg.workload.name}/{cfg.mode.name}/{cfg.profile.name}"
    progress = Progress(cfg.warmup + cfg.steps + (1 if allocator else 2), label)
    # measured: the allocator's step (peak_bytes); instrumented: tracker + FLOP counter
    phases = ["warmup"] * cfg.warmup + [TIMED_PHASE] * cfg.steps + ["measured", "instrumented"]
    rows: list[dict] = []
    process = psutil.Process()

    def step():
        t0 = time.perf_counter()
        loss = workload.step_loss(module, batch)
        loss.backward()
        elapsed = time.perf_counter() - t0
        phase = phases[min(len(rows), len(phases) - 1)]
        # `loss` as is, not detached: an op after backward would be tracked as forward.
        rss_mb = process.memory_info().rss / MIB
        rows.append(
            dict(step=len(rows), phase=phase, step_time_s=elapsed, loss=loss, rss_mb=rss_mb)
        )
        progress.update(phase, elapsed)
        return loss

    torch.manual_seed(cfg.seed)
    rss, gpu = RssSampler(), _gpu_sampler(device)
    with rss:
        if gpu is not None:
            gpu.start()
        try:
            measured = measure_step(
                step, params=params, warmup=cfg.warmup, repeats=cfg.steps, device=device,
                count_flops=not allocator, track_tensors=not allocator,
            )  # fmt: skip
        finally:
            if gpu is not None:
                gpu.stop()

    steps = pd.DataFrame(rows)
    steps["loss"] = [float(v.detach()) for v in steps["loss"]]
    timed = steps.index[steps["phase"] == TIMED_PHASE]
    steps.loc[timed, "step_time_s"] = measured.step_times  # the Timer's numbers (CUDA-synced)
    resources = rss.results() | (gpu.results() if gpu is not None else {})
    return measured, steps, resources


def reference_checks(cfg, workload, module, batch, params, device, flops) -> dict:
    """naive_flops, and with `verify` grad_max_rel_error / verify_passed, from a plain-autograd
    copy of the workload (built only when needed)."""
    same_build = workload_overrides(cfg) == workload_overrides(cfg, with_mode_options=False)
    result = {"naive_flops": flops if cfg.mode.name == "naive" and same_build else None}
    if not cfg.verify and (result["naive_flops"] is not None or not cfg.count_naive_flops):
        return result
    from hbp.runtime.flops import TotalFlopCounterMode
    from hbp.runtime.measure import step_peak

    reference = build_workload(cfg, with_mode_options=False)
    reference.model.to(device)
    ref_params = list(reference.model.parameters())
    # Gradients are compared on the plain execution path: under a dispatch mode such as the
    # FLOP counter, composite ops (scaled_dot_product_attention) may decompose differently
    # and round differently. So the FLOPs get a step of their own.
    if cfg.verify:
        grads, _ = _step_gradients(module, workload, batch, params, cfg.seed)
        ref_grads, _ = _step_gradients(reference.model, reference, batch, ref_params, cfg.seed)
        error = max_relative_grad_error(grads, ref_grads)
        result["grad_max_rel_error"] = error
        result["verify_passed"] = bool(error < GRAD_TOLERANCE)
    if result["naive_flops"] is None and cfg.count_naive_flops:

        def naive_step():  # as the run's steps are measured: no copy of the gradients
            _step(reference.model, reference, batch, ref_params, cfg.seed)

        _, result["naive_peak_bytes"] = step_peak(naive_step, device)  # the allocator's
        with TotalFlopCounterMode() as counter:
            naive_step()
        result["naive_flops"] = int(counter.get_total_flops())
    return result
