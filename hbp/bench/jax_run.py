"""framework=jax: one run's measurement (`measure_jax`); the runner writes it like a torch run.

The step is `jax.jit(mode.apply(workload))`: `(params, *batch) -> (grads, loss)`, compiled
once, ahead of time, and then called as compiled. NOTE [ JAX step metrics ]:

- `peak_bytes` = temp + output - alias bytes of the compiled step's `memory_analysis()`: what
  the step allocates above what existed before it (parameters and batch, the arguments, are
  not counted, as the torch peak does not count the weights; the gradients, outputs, are).
  XLA:CPU allocates the temp buffer whole for the call, so this is the step's footprint as
  compiled. `xla_temp_bytes`, `xla_output_bytes`, `xla_argument_bytes`, `xla_alias_bytes`
  are the parts.
- Cross-check, process max-RSS growth (Linux: the high-water mark reset right before the
  call): `rss_first_call_growth_bytes` for the first call of the compiled program (nothing
  of the program's memory was resident before it), `rss_growth_bytes` for the measured call
  after the timed steps (its baseline read once the previous call's temp buffer has been
  released: NOTE [ RSS baseline after a previous call ] in hbp/integrations/jax/measure.py).
  Before building anything the run asks glibc to serve allocations of 64 KiB and more by
  mmap and to give freed memory back at once (`mallopt`, what
  `MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0` do at start-up): otherwise memory
  freed by an earlier job of the same multirun process is reused without growing RSS, and
  the first call's growth says nothing.
- `flops`: `cost_analysis()["flops"]` of the compiled step (XLA's count, after its
  optimisations); `naive_flops` the same for `jax.jit(jax.grad(loss))`.
- `step_time_s`: median of the timed calls (`block_until_ready`), after `warmup` calls.
- No tensor tracker in JAX: `tensor_peak_bytes`, `scratch_bytes` and the per-phase peaks are
  null, and there is no memory timeline.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pandas as pd
import psutil

from hbp.bench.jax_config import build_jax_workload, resolve_jax_device
from hbp.bench.step import GRAD_TOLERANCE, MIB, Progress
from hbp.telemetry.samplers import RssSampler
from hbp.telemetry.tables import TIMED_PHASE


def measure_jax(cfg) -> tuple[object, dict, pd.DataFrame]:
    """Build, compile and measure the configured JAX run: (mode, summary row without the
    run's bookkeeping fields, per-step DataFrame). NOTE [ JAX step metrics ]."""
    import jax

    from hbp.integrations.jax.measure import rss_growth
    from hbp.modes import build_mode

    device = resolve_jax_device(cfg.device)
    mode = build_mode(cfg.mode, framework="jax")
    return_freed_memory()
    with jax.default_device(device):
        workload = build_jax_workload(cfg)
        params, batch = jax.device_put((workload.params, workload.batch), device)
        grad_fn = mode.apply(workload)
        if hasattr(mode, "summary"):
            print(mode.summary(), flush=True)
        t0 = time.perf_counter()
        step = jax.jit(grad_fn).lower(params, *batch).compile()
        compile_s = time.perf_counter() - t0
        memory = compiled_memory(step)
        label = f"jax/{cfg.workload.name}/{cfg.mode.name}/{cfg.profile.name}"
        progress = Progress(cfg.warmup + cfg.steps + 2, label)
        rows: list[dict] = []
        with RssSampler() as rss:
            first_growth, first_s, out = rss_growth(step, params, *batch)
            rows.append(_step_row(rows, "first", first_s, out))
            for phase in ["warmup"] * cfg.warmup + [TIMED_PHASE] * cfg.steps:
                t0 = time.perf_counter()
                out = jax.block_until_ready(step(params, *batch))
                rows.append(_step_row(rows, phase, time.perf_counter() - t0, out))
                progress.update(phase, rows[-1]["step_time_s"])
            del out
            growth, measured_s, out = rss_growth(step, params, *batch)
            rows.append(_step_row(rows, "measured", measured_s, out))
        grads, loss = out
        timed = [r["step_time_s"] for r in rows if r["phase"] == TIMED_PHASE]
        row = {
            "status": "ok",
            "framework": "jax",
            "workload": cfg.workload.name,
            "mode": cfg.mode.name,
            "profile": cfg.profile.name,
            "device": str(device),
            "seed": cfg.seed,
            "steps": cfg.steps,
            "warmup": cfg.warmup,
        }
        row.update({f"mode_{k}": v for k, v in mode.describe().items() if k != "name"})
        row.update({f"workload_{k}": v for k, v in workload.config.items()})
        row["params"] = workload.config["params"]
        row["loss"] = float(loss)
        row.update(memory)
        row["peak_mib"] = memory["peak_bytes"] / MIB
        row.update(peak_forward_bytes=None, peak_backward_bytes=None)
        row.update(tensor_peak_bytes=None, scratch_bytes=None)
        row["flops"] = compiled_flops(step)
        row["rss_first_call_growth_bytes"] = _growth(first_growth)
        row["rss_growth_bytes"] = _growth(growth)
        row["compile_time_s"] = compile_s
        row.update(_time_fields(timed))
        for unit in ("samples", "tokens"):
            per_batch = workload.config.get(f"{unit}_per_batch")
            if per_batch:
                row[f"{unit}_per_s"] = per_batch / row["step_time_s"]
        row.update(rss.results())
        row.update(_reference_checks(cfg, workload, params, batch, grads, row))
        row["optimizer_step_s"] = time_adamw(params, grads, max(1, min(cfg.steps, 5)))
    row.update(_environment(device))
    return mode, row, pd.DataFrame(rows)


def return_freed_memory(threshold: int = 1 << 16) -> bool:
    """glibc only: allocations >= `threshold` bytes by mmap, freed memory trimmed at once
    (NOTE [ JAX step metrics ]). False where mallopt is not available."""
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(
            libc.mallopt(m_trim_threshold, 0)
        )
    except (OSError, AttributeError):
        return False


def compiled_memory(compiled) -> dict:
    """peak_bytes and its parts from a compiled step's memory analysis (NOTE [ JAX step
    metrics ])."""
    analysis = compiled.memory_analysis()
    temp = int(analysis.temp_size_in_bytes)
    output = int(analysis.output_size_in_bytes)
    alias = int(analysis.alias_size_in_bytes)
    return {
        "peak_bytes": temp + output - alias,
        "xla_temp_bytes": temp,
        "xla_output_bytes": output,
        "xla_argument_bytes": int(analysis.argument_size_in_bytes),
        "xla_alias_bytes": alias,
    }


def compiled_flops(compiled) -> int | None:
    """XLA's FLOP count of a compiled program (None where the backend gives none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return int(flops) if flops is not None else None


def _growth(measured: int) -> int | None:
    """`rss_growth`'s figure: None where the high-water mark could not be reset (-1), else at
    least 0 (RSS can drop between the baseline reading and the reset)."""
    return None if measured == -1 else max(measured, 0)


def _step_row(rows: list, phase: str, elapsed: float, out) -> dict:
    """One steps.parquet row, as the torch runs' (`hbp.bench.step.measure_steps`)."""
    return {
        "step": len(rows),
        "phase": phase,
        "step_time_s": elapsed,
        "loss": float(out[1]),
        "rss_mb": psutil.Process().memory_info().rss / MIB,
    }


def _time_fields(times: list[float]) -> dict:
    ordered = np.asarray(times)
    return {
        "step_time_s": statistics.median(times),
        "step_time_p10": float(np.percentile(ordered, 10)),
        "step_time_p90": float(np.percentile(ordered, 90)),
        "step_time_mean": float(ordered.mean()),
        "step_time_std": float(ordered.std(ddof=1)) if len(times) > 1 else 0.0,
    }


def _reference_checks(cfg, workload, params, batch, grads, row) -> dict:
    """naive_flops / naive_peak_bytes (the compiled `jax.jit(jax.grad(loss))`) and with
    `verify` grad_max_rel_error / verify_passed against its gradients."""
    import jax

    naive = cfg.mode.name == "naive"
    result: dict = {"naive_flops": row["flops"] if naive else None}
    if naive:
        result["naive_peak_bytes"] = row["peak_bytes"]
    if naive:  # the step is the reference
        if cfg.verify:
            result.update(grad_max_rel_error=0.0, verify_passed=True)
        return result | {"peak_vs_naive": 1.0, "recompute_ratio": 0.0}
    if not cfg.verify and not cfg.count_naive_flops:
        return result | {"recompute_ratio": None}
    reference = jax.jit(jax.grad(workload.loss_and_aux, has_aux=True))
    compiled = reference.lower(params, *batch).compile()
    if cfg.count_naive_flops:
        result["naive_flops"] = compiled_flops(compiled)
        result["naive_peak_bytes"] = compiled_memory(compiled)["peak_bytes"]
    if cfg.verify:
        ref_grads, _ = compiled(params, *batch)
        error = max_relative_grad_error(grads, ref_grads)
        result["grad_max_rel_error"] = error
        result["verify_passed"] = bool(error < GRAD_TOLERANCE)
    if row["peak_bytes"] is not None and result.get("naive_peak_bytes"):
        result["peak_vs_naive"] = row["peak_bytes"] / result["naive_peak_bytes"]
    if result["naive_flops"] and row["flops"] is not None:
        result["recompute_ratio"] = row["flops"] / result["naive_flops"] - 1
    else:
        result["recompute_ratio"] = None
    return result


def max_relative_grad_error(grads, ref_grads) -> float:
    """max over parameter leaves of max|g - g_ref| / max|g_ref| (absolute where g_ref is all
    zero); inf when the pytrees differ in structure or shapes."""
    import jax

    if jax.tree.structure(grads) != jax.tree.structure(ref_grads):
        return float("inf")
    worst = 0.0
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        g, r = np.asarray(g), np.asarray(r)
        if g.shape != r.shape:
            return float("inf")
        scale = float(np.abs(r).max()) if r.size else 0.0
        error = float(np.abs(g - r).max()) if r.size else 0.0
        worst = max(worst, error / scale if scale > 0 else error)
    return worst


def time_adamw(params, grads, repeats: int, lr: float = 1e-4) -> float:
    """Median seconds of `repeats` AdamW updates of `params` by `grads`, the parameters and
    gradients flattened into one vector each (as fused optimizers run them; one small jitted
    program, plain JAX; the first, compiling call is not timed). The torch runs time torch's
    AdamW."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    b1, b2, eps, decay = 0.9, 0.999, 1e-8, 0.01

    @jax.jit
    def update(p, m, v, g, t):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        return p - lr * (m_hat / (jnp.sqrt(v_hat) + eps) + decay * p), m, v

    flat_params, flat_grads = ravel_pytree(params)[0], ravel_pytree(grads)[0]
    zeros = np.zeros(flat_params.shape, np.float32)
    state = jax.block_until_ready(update(flat_params, zeros, zeros, flat_grads, 1.0))
    times = []
    for t in range(repeats):
        start = time.perf_counter()
        state = jax.block_until_ready(update(*state, flat_grads, t + 2.0))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _environment(device) -> dict:
    """The torch runs' environment fields, with JAX's versions and device."""
    import jax
    import jaxlib

    from hbp.telemetry.environment import capture_environment

    env = capture_environment("cpu")
    env.pop("torch_version", None)
    env["device"] = str(device)
    if device.platform != "cpu":
        env["device_name"] = device.device_kind
    env["threads"] = None  # XLA's thread pools, not torch's (XLA_FLAGS sets them)
    env["jax_version"] = jax.__version__
    env["jaxlib_version"] = jaxlib.__version__
    env["jax_backend"] = device.platform
    return env
