"""One benchmark run: config -> workload -> mode -> warm-up, timed steps, one measured step ->
one summary row (metrics.json) + per-step rows -> loggers.

    row = hbp.bench.run(cfg)            # cfg: the composed Hydra config (conf/config.yaml)

A step is forward + loss + backward of the workload under the mode (docs/architecture.md "Metrics");
`hbp.runtime.measure_step` runs the `warmup` untimed steps, the `steps` timed steps and the
measured step (exact peak bytes, FLOPs, memory timeline). Then, outside the timed steps:

- `verify=true`: the mode's step and a plain-autograd step on a second copy of the workload
  (same seed, so the same weights; same batch; same RNG seed, so the same dropout masks);
  `grad_max_rel_error` = max over parameters of max|g - g_ref| / max|g_ref|, and
  `verify_passed` = error < GRAD_TOLERANCE (float32).
- `recompute_ratio` = flops / naive_flops - 1. `naive_flops` is the measured step's FLOPs
  for mode=naive; otherwise it is counted on that naive copy (reused from `verify`). The
  copy costs one model and one step; `count_naive_flops=false` skips it (recompute_ratio is
  then null) for big profiles where that matters.
- `optimizer_step_s`: the median time of AdamW steps over the model's parameters, timed apart
  from the forward + backward step (first AdamW step, which allocates its state, untimed).

The metrics.json row is flat: run fields, the mode's `describe()` prefixed `mode_`, the
workload's config facts prefixed `workload_`, measurements, environment, and `config` (the
whole resolved config, nested; `hbp.analysis.collect` flattens it into `config.*` columns).

Layout (one concern per module): `config` (validation, device, threads, the workload),
`rundir` (run directories, run keys, resuming a sweep), `step` (driving the measurement),
`runner` (`run`: one run end to end), `workload_options` (the workload's overrides), `jax_config` and `jax_run` (framework=jax: its checks,
and the JAX step's measurement, NOTE [ JAX step metrics ]), `summary` (the printed table), `cli` (Hydra glue: `hydra_main`,
`RunGuard`). Only run.py (and tests) import this package; the library never
does.
"""

from __future__ import annotations

from hbp.bench.cli import RunGuard, hydra_main
from hbp.bench.config import (
    MAX_AUTO_THREADS,
    build_workload,
    check_writable,
    launcher_cpus_per_task,
    parallel_jobs,
    resolve_device,
    resolve_threads,
    validate,
)
from hbp.bench.rundir import (
    default_run_dir,
    finished_run,
    register_resolvers,
    remove_run_dir,
    run_key,
)
from hbp.bench.runner import run, summary_row, write_outputs
from hbp.bench.step import (
    GRAD_TOLERANCE,
    max_relative_grad_error,
    measure_steps,
    reference_checks,
    time_optimizer_step,
)
from hbp.bench.summary import format_summary, summary_frame
from hbp.bench.workload_options import MODE_WORKLOAD_OPTIONS, workload_overrides

__all__ = [
    "GRAD_TOLERANCE",
    "MAX_AUTO_THREADS",
    "MODE_WORKLOAD_OPTIONS",
    "RunGuard",
    "build_workload",
    "check_writable",
    "default_run_dir",
    "finished_run",
    "format_summary",
    "hydra_main",
    "launcher_cpus_per_task",
    "max_relative_grad_error",
    "measure_steps",
    "parallel_jobs",
    "reference_checks",
    "register_resolvers",
    "remove_run_dir",
    "resolve_device",
    "resolve_threads",
    "run",
    "run_key",
    "summary_frame",
    "summary_row",
    "time_optimizer_step",
    "validate",
    "workload_overrides",
    "write_outputs",
]

register_resolvers()
