"""One benchmark run: config -> workload -> mode -> warm-up, timed steps, one measured step ->
one summary row (metrics.json) + per-step rows -> loggers.

    row = hbp.bench.run(cfg)            # cfg: the composed Hydra config (conf/config.yaml)

A step is forward + loss + backward of the workload under the mode (DESIGN.md "Metrics");
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

`hydra_main` is run.py's task function (the error contract: see its docstring) and `RunGuard`
the Hydra callback that rejects bad input before Hydra creates any directory.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import pandas as pd
import psutil
import torch
from omegaconf import DictConfig, OmegaConf

from hbp.errors import ConfigError, HBPError
from hbp.modes import MODES, build_mode
from hbp.telemetry import LOGGERS, make_loggers
from hbp.telemetry.environment import capture_environment
from hbp.telemetry.samplers import GpuSampler, RssSampler
from hbp.telemetry.tables import (
    ERROR_FILE,
    METRICS_FILE,
    write_artifacts,
    write_config,
    write_error,
    write_metrics,
)

try:  # Hydra is a dependency, but `run` works without an initialised Hydra
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object

log = logging.getLogger("hbp.bench")

MIB = 1024 * 1024
GRAD_TOLERANCE = 1e-4
DEVICES = ("auto", "cpu", "cuda")
MAX_AUTO_THREADS = 16
# Mode options that change how the workload is built (only passed to workloads that have the
# field, and only where the workload config leaves it null).
MODE_WORKLOAD_OPTIONS = ("chunked_loss",)
# Files Hydra writes into a run directory before the task starts.
HYDRA_FILES = (".hydra", "run.log")


# -- configuration ---------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_device(name) -> torch.device:
    """`auto` -> cuda if available else cpu; `cpu`; `cuda` / `cuda:N` (ConfigError when there
    is no such CUDA device)."""
    text = str(name)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index = text.partition(":")[2]
        if not torch.cuda.is_available():
            raise ConfigError("device", text, "auto or cpu: no CUDA device is available here")
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            count = torch.cuda.device_count()
            raise ConfigError("device", text, f"auto, cpu, cuda or cuda:0..cuda:{count - 1}")
        return torch.device(text)
    raise ConfigError("device", text, "one of " + ", ".join(DEVICES) + " (or cuda:N)")


def parallel_jobs() -> int:
    """How many jobs run at once: the parallel launcher's n_jobs in a Hydra multirun (joblib
    semantics: -1 = one per CPU), else 1."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return 1
        n_jobs = HydraConfig.get().launcher.get("n_jobs")
    except Exception:
        return 1
    if not _is_int(n_jobs) or n_jobs == 0:
        return 1
    return n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)


def resolve_threads(threads, jobs: int = 1) -> int:
    """torch intra-op threads: `threads` if set; else OMP_NUM_THREADS if set (joblib sets it
    in its workers); else the CPUs this process may use, at most MAX_AUTO_THREADS, divided
    among `jobs` parallel jobs."""
    if threads is not None:
        return int(threads)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, MAX_AUTO_THREADS) // max(1, jobs))


def check_writable(path) -> None:
    """ConfigError("output_root", ...) unless `path` exists as a writable directory or could be
    created (its nearest existing ancestor is a writable directory on a writable filesystem).
    Creates nothing."""
    target = Path(path).absolute()
    ancestor = target
    while not ancestor.exists():
        ancestor = ancestor.parent
    why = None
    if not ancestor.is_dir():
        why = f"{ancestor} is not a directory"
    elif not os.access(ancestor, os.W_OK | os.X_OK):
        why = f"{ancestor} is not writable"
    elif hasattr(os, "statvfs") and os.statvfs(ancestor).f_flag & os.ST_RDONLY:
        why = f"{ancestor} is on a read-only filesystem"
    if why:
        raise ConfigError("output_root", str(path), f"a writable directory ({why})")


def workload_overrides(cfg, with_mode_options: bool = True) -> dict:
    """Keyword overrides for `hbp.workloads.build`: the workload config's non-null fields and,
    with `with_mode_options`, the mode's MODE_WORKLOAD_OPTIONS (e.g. chunked_loss) for fields
    the workload has and leaves null."""
    fields = OmegaConf.to_container(cfg.workload, resolve=True)
    fields.pop("name", None)
    overrides = {k: v for k, v in fields.items() if v is not None}
    if with_mode_options:
        for key in MODE_WORKLOAD_OPTIONS:
            if key in fields and fields[key] is None and cfg.mode.get(key) is not None:
                overrides[key] = cfg.mode.get(key)
    return overrides


def build_workload(cfg, with_mode_options: bool = True):
    """The configured workload, on CPU (see `hbp.workloads.build`)."""
    from hbp.workloads import build

    overrides = workload_overrides(cfg, with_mode_options)
    return build(cfg.workload.name, cfg.profile.name, seed=cfg.seed, **overrides)


def validate(cfg) -> None:
    """Reject bad input with a ConfigError naming the field and the accepted values. Cheap and
    side-effect free: builds no model, creates no directory."""
    from hbp.workloads import PROFILES, WORKLOADS, resolve_config

    def need(ok: bool, field: str, accepted: str) -> None:
        if not ok:
            raise ConfigError(field, OmegaConf.select(cfg, field), accepted)

    need(cfg.workload.name in WORKLOADS, "workload.name", "one of " + ", ".join(WORKLOADS))
    need(cfg.profile.name in PROFILES, "profile.name", "one of " + ", ".join(PROFILES))
    need(cfg.mode.name in MODES, "mode.name", "one of " + ", ".join(MODES))
    need(cfg.logger.name in LOGGERS, "logger.name", "one of " + ", ".join(LOGGERS))
    need(_is_int(cfg.steps) and cfg.steps >= 1, "steps", "an integer >= 1")
    need(_is_int(cfg.warmup) and cfg.warmup >= 0, "warmup", "an integer >= 0")
    need(_is_int(cfg.seed), "seed", "an integer")
    need(isinstance(cfg.verify, bool), "verify", "true or false")
    need(isinstance(cfg.count_naive_flops, bool), "count_naive_flops", "true or false")
    need(
        cfg.threads is None or (_is_int(cfg.threads) and cfg.threads >= 1),
        "threads",
        "null (automatic) or an integer >= 1",
    )
    resolve_device(cfg.device)
    resolve_config(cfg.workload.name, cfg.profile.name, **workload_overrides(cfg))
    build_mode(cfg.mode)
    check_writable(cfg.output_root)


def default_run_dir(cfg) -> Path:
    """Hydra's output dir for this job when Hydra runs us; else the same layout by hand."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:  # pragma: no cover
        pass
    now = datetime.now()
    name = f"{now:%H-%M-%S}_{cfg.workload.name}_{cfg.mode.name}"
    return Path(cfg.output_root) / "runs" / f"{now:%Y-%m-%d}" / name


# -- the run -----------------------------------------------------------------------------------


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


def _step_gradients(module, workload, batch, params, seed):
    """One step of `module` from `seed`: (parameter gradients, cloned; loss)."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = workload.step_loss(module, batch)
    loss.backward()
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


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Run one benchmark and write its outputs into `run_dir` (default: Hydra's output dir).

    Returns the summary row (also written to run_dir/metrics.json, last, so a metrics.json
    means a finished run). Raises ConfigError on bad input before anything is written."""
    started_at = datetime.now().astimezone()
    t_start = time.perf_counter()
    validate(cfg)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    check_writable(run_dir)
    device = resolve_device(cfg.device)
    torch.set_num_threads(resolve_threads(cfg.threads, parallel_jobs()))

    mode = build_mode(cfg.mode)
    workload = build_workload(cfg)
    workload.model.to(device)
    batch = workload.make_batch(cfg.seed).to(device)
    module = mode.apply(workload, batch)
    params = list(workload.model.parameters())
    if hasattr(mode, "summary"):
        print(mode.summary(), flush=True)

    allocator = getattr(mode, "measure_with", "tracker") == "allocator"
    measured, steps, resources = measure_steps(
        cfg, workload, module, batch, params, device, allocator=allocator
    )
    row = summary_row(cfg, mode, workload, measured, device)
    row.update(resources)
    row.update(reference_checks(cfg, workload, module, batch, params, device, measured.flops))
    row["recompute_ratio"] = (
        measured.flops / row["naive_flops"] - 1 if row["naive_flops"] and measured.flops else None
    )
    if cfg.mode.name == "naive" and row.get("naive_peak_bytes") is None:
        row["naive_peak_bytes"] = measured.peak_bytes
    if row.get("naive_peak_bytes") and measured.peak_bytes is not None:
        row["peak_vs_naive"] = measured.peak_bytes / row["naive_peak_bytes"]
    row["optimizer_step_s"] = time_optimizer_step(params, device, max(1, min(cfg.steps, 5)))
    row.update(capture_environment(device))
    row["started_at"] = started_at.isoformat(timespec="milliseconds")
    row["run_dir"] = str(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    row["config"] = config

    timeline = measured.timeline if measured.timeline is not None else pd.DataFrame()
    write_outputs(cfg, run_dir, mode, row, steps, timeline)
    row["wall_s"] = time.perf_counter() - t_start
    write_metrics(run_dir, row)
    print(format_summary([row]), flush=True)
    return row


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
    phases = ["warmup"] * cfg.warmup + ["timed"] * cfg.steps + ["measured", "instrumented"]
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
    timed = steps.index[steps["phase"] == "timed"]
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

        def naive_step():
            return _step_gradients(reference.model, reference, batch, ref_params, cfg.seed)

        _, result["naive_peak_bytes"] = step_peak(naive_step, device)  # the allocator's
        with TotalFlopCounterMode() as counter:
            naive_step()
        result["naive_flops"] = int(counter.get_total_flops())
    return result


def summary_row(cfg, mode, workload, measured, device: torch.device) -> dict:
    """The run's fields, the mode's describe() (mode_*), the workload's facts (workload_*) and
    the measured step's numbers."""
    facts = dict(workload.config)
    row: dict = {
        "status": "ok",
        "workload": cfg.workload.name,
        "mode": cfg.mode.name,
        "profile": cfg.profile.name,
        "device": str(device),
        "seed": cfg.seed,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
    }
    row.update({f"mode_{k}": v for k, v in mode.describe().items() if k != "name"})
    row.update({f"workload_{k}": v for k, v in facts.items()})
    row["params"] = facts.get("params", sum(p.numel() for p in workload.model.parameters()))
    row["loss"] = float(measured.last_output) if measured.last_output is not None else None
    row["peak_bytes"] = measured.peak_bytes
    row["peak_mib"] = measured.peak_bytes / MIB if measured.peak_bytes is not None else None
    row.update({f"peak_{phase}_bytes": v for phase, v in measured.peak_by_phase.items()})
    row["tensor_peak_bytes"] = measured.tensor_peak_bytes
    row["scratch_bytes"] = measured.scratch_bytes
    row["flops"] = measured.flops
    row["step_time_s"] = measured.step_time_s
    row["step_time_p10"] = measured.step_time_p10
    row["step_time_p90"] = measured.step_time_p90
    row["step_time_mean"] = measured.time_summary.get("mean")
    row["step_time_std"] = measured.time_summary.get("std")
    for unit in ("samples", "tokens"):
        per_batch = facts.get(f"{unit}_per_batch")
        if per_batch:
            row[f"{unit}_per_s"] = per_batch / measured.step_time_s
    return row


def write_outputs(cfg, run_dir: Path, mode, row: dict, steps, timeline) -> None:
    """config.yaml, the mode's artifacts() files, then the loggers (a failing wandb logger is
    a warning and a `logger_errors` entry, never a lost run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, row["config"])
    if hasattr(mode, "artifacts"):
        write_artifacts(run_dir, mode.artifacts())
    for logger in make_loggers(cfg.logger, run_dir, run_name=run_dir.name):
        try:
            logger.log_run(row, steps, timeline)
        except Exception as error:
            if logger.name == "table":
                raise
            log.warning("logger %s failed: %s: %s", logger.name, type(error).__name__, error)
            row.setdefault("logger_errors", []).append(f"{logger.name}: {error}")


# -- reporting --------------------------------------------------------------------------------


def summary_frame(rows) -> pd.DataFrame:
    """The short summary table of runs: workload, mode, peak MiB, GFLOPs, step time (median
    and p10-p90, ms), recompute ratio; predicted peak MiB where a mode predicts one."""
    frame = pd.DataFrame(list(rows))
    table = pd.DataFrame(
        {
            "workload": frame["workload"],
            "mode": [mode_label(row) for row in frame.to_dict(orient="records")],
            "peak MiB": frame["peak_bytes"] / MIB,
            "GFLOPs": frame["flops"] / 1e9,
            "step ms": frame["step_time_s"] * 1e3,
            "p10-p90 ms": [
                f"{a * 1e3:.1f}-{b * 1e3:.1f}"
                for a, b in zip(frame["step_time_p10"], frame["step_time_p90"])
            ],
            "recompute": frame.get("recompute_ratio"),
        }
    )
    if "mode_predicted_peak_bytes" in frame:
        table["predicted MiB"] = frame["mode_predicted_peak_bytes"] / MIB
    if "naive_peak_bytes" in frame:
        table["naive MiB"] = frame["naive_peak_bytes"] / MIB
        table["peak / naive"] = frame["peak_bytes"] / frame["naive_peak_bytes"]
    if "grad_max_rel_error" in frame:
        table["grad err"] = frame["grad_max_rel_error"]
    return table


def mode_label(row: Mapping) -> str:
    """ "checkpoint(block_size=2)": the mode and its configured parameters that are set."""
    params = (row.get("config") or {}).get("mode") or {}
    shown = [f"{k}={v}" for k, v in params.items() if k != "name" and v not in (None, False)]
    return f"{row['mode']}({', '.join(shown)})" if shown else str(row["mode"])


def format_summary(rows) -> str:
    table = summary_frame(rows)
    return table.to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep="-")


# -- Hydra glue: the error contract ------------------------------------------------------------


def _fail(message: str, code: int = 2):
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def remove_run_dir(run_dir: Path, output_root: Path) -> bool:
    """Undo what Hydra created for a run rejected before it wrote anything: the run dir, if it
    holds only Hydra's own files, and the then-empty directories above it up to output_root
    (which stays). Returns whether the run dir is gone."""
    run_dir, root = Path(run_dir).absolute(), Path(output_root).absolute()
    if not run_dir.is_dir():
        return True
    if any(p.name not in HYDRA_FILES for p in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != root and root in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
    return True


def hydra_main(cfg: DictConfig) -> dict | None:
    """run.py's task function: `run(cfg)` under the error contract.

    - Bad input (ConfigError or any other hbp error, e.g. an infeasible budget) in a single
      run: "error: <field>=<value> is not accepted: expected <accepted values>" on stderr,
      exit code 2, and the run dir Hydra made is removed (nothing else was written).
    - Any other exception in a single run: error.json in the run dir, then Hydra reports the
      traceback (exit code 1).
    - In a multirun every failure writes error.json (no metrics.json) in the job's dir and the
      sweep goes on; `RunGuard` reports the failures at the end and exits non-zero.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    run_dir = default_run_dir(cfg)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return run(cfg, run_dir)
    except Exception as error:
        bad_input = isinstance(error, HBPError) and not multirun
        if bad_input and remove_run_dir(run_dir, Path(cfg.output_root)):
            _fail(str(error))
        context = {
            "workload": cfg.workload.name,
            "mode": cfg.mode.name,
            "profile": cfg.profile.name,
            "run_dir": str(run_dir),
        }
        try:
            context["config"] = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # an unresolvable config is itself the error
            pass
        write_error(run_dir, error, context)
        if bad_input:  # raised after the run had written files: keep them, with error.json
            _fail(f"{error} (see {run_dir / ERROR_FILE})")
        if not multirun:
            raise
        log.error(
            "%s failed: %s: %s (see %s)",
            run_dir.name,
            type(error).__name__,
            error,
            run_dir / ERROR_FILE,
        )
        return None


class RunGuard(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks.guard`).

    on_run_start / on_multirun_start: validate the composed config and the output directory
    before Hydra creates anything; bad input -> "error: ..." on stderr, exit code 2.
    on_multirun_end: the summary table of the sweep's finished runs; if any job failed, list
    them and exit with code 1.
    """

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, config.hydra.sweep.dir)

    def _check(self, config: DictConfig, out_dir: str) -> None:
        try:
            validate(config)
            check_writable(out_dir)
        except HBPError as error:
            _fail(str(error))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        done = sorted(sweep_dir.glob(f"*/{METRICS_FILE}"))
        failed = sorted(sweep_dir.glob(f"*/{ERROR_FILE}"))
        if done:
            from hbp.telemetry.tables import read_json

            print(f"\n{len(done)} runs in {sweep_dir}:")
            print(format_summary(read_json(p) for p in done), flush=True)
        if failed:
            names = ", ".join(p.parent.name for p in failed)
            _fail(
                f"{len(failed)} of {len(done) + len(failed)} runs failed: {names} "
                f"(see error.json in each)",
                code=1,
            )
