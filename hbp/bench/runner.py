"""One run: config -> workload -> mode -> measured step -> summary row -> run directory and
loggers (`run`); the summary row's fields (`summary_row`); the files (`write_outputs`).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

import hbp.bench.distributed as distributed
from hbp.bench.config import (
    build_workload,
    check_writable,
    framework,
    launcher_cpus_per_task,
    parallel_jobs,
    resolve_device,
    resolve_threads,
    validate,
)
from hbp.bench.rundir import default_run_dir, run_key
from hbp.bench.step import MIB, measure_steps, reference_checks, time_optimizer_step
from hbp.bench.summary import format_summary
from hbp.modes import build_mode
from hbp.telemetry import make_loggers
from hbp.telemetry.environment import capture_environment, model_libraries
from hbp.telemetry.tables import write_artifacts, write_config, write_metrics

log = logging.getLogger("hbp.bench")


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Run one benchmark and write its outputs into `run_dir` (default: Hydra's output dir).

    Returns the summary row (also written to run_dir/metrics.json, last, so a metrics.json
    means a finished run). Raises ConfigError on bad input before anything is written."""
    started_at = datetime.now().astimezone()
    t_start = time.perf_counter()
    validate(cfg)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    check_writable(run_dir)
    if framework(cfg) == "jax":
        from hbp.bench.jax_run import measure_jax

        mode, row, steps = measure_jax(cfg)
        return _finish(cfg, run_dir, mode, row, steps, pd.DataFrame(), started_at, t_start)
    place = distributed.setup(cfg)
    try:
        return _run(cfg, run_dir, place, started_at, t_start)
    finally:
        distributed.teardown(place)


def _run(cfg, run_dir: Path, place, started_at, t_start: float) -> dict:
    device = distributed.device_for(place, resolve_device(cfg.device))
    torch.set_num_threads(
        resolve_threads(cfg.threads, parallel_jobs(), per_job=launcher_cpus_per_task())
    )

    mode = build_mode(cfg.mode)
    if cfg.get("plan_cache") and getattr(mode, "plan_cache", False) is None:
        mode.plan_cache = str(cfg.plan_cache)  # NOTE [ Run keys ]: where plans are kept
    workload = build_workload(cfg)
    workload.model.to(device)
    batch = workload.make_batch(distributed.batch_seed(cfg.seed, place)).to(device)
    module = distributed.wrap(mode.apply(workload, batch), place, device)
    params = list(workload.model.parameters())  # after fully_shard: the sharded parameters
    if hasattr(mode, "summary") and place.is_main:
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
    row.update(model_libraries(workload.model))
    if place.enabled:  # a collective: every rank gathers
        row["distributed"] = place.kind
        row["world_size"] = place.world_size
        row["rank_peak_bytes"] = distributed.gather(measured.peak_bytes, place)
    if not place.is_main:  # only rank 0 writes
        return _describe_run(cfg, row, run_dir, started_at)
    timeline = measured.timeline if measured.timeline is not None else pd.DataFrame()
    return _finish(cfg, run_dir, mode, row, steps, timeline, started_at, t_start)


def _describe_run(cfg, row: dict, run_dir: Path, started_at) -> dict:
    """The run's bookkeeping fields: start time, run dir, the resolved config and its key."""
    row["started_at"] = started_at.isoformat(timespec="milliseconds")
    row["run_dir"] = str(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    row["config"] = config
    row["run_key"] = run_key(config)
    return row


def _finish(cfg, run_dir: Path, mode, row: dict, steps, timeline, started_at, t_start) -> dict:
    """Write the run (config, artifacts, loggers, metrics.json last) and print its summary."""
    _describe_run(cfg, row, run_dir, started_at)
    write_outputs(cfg, run_dir, mode, row, steps, timeline)
    row["wall_s"] = time.perf_counter() - t_start
    write_metrics(run_dir, row)
    if not _multirun():  # a sweep prints every run's row once, at its end (RunGuard)
        print(format_summary([row]), flush=True)
        print(f"wrote {run_dir}", flush=True)
    return row


def _multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except ImportError:  # pragma: no cover
        return False


def summary_row(cfg, mode, workload, measured, device: torch.device) -> dict:
    """The run's fields, the mode's describe() (mode_*), the workload's facts (workload_*) and
    the measured step's numbers."""
    facts = dict(workload.config)
    row: dict = {
        "status": "ok",
        "framework": "torch",
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
    context = sweep_context(cfg, run_dir)
    loggers = make_loggers(cfg.logger, run_dir, run_name=run_dir.name, **context)
    figures = {}
    if any(getattr(logger, "wants_figures", False) for logger in loggers):
        figures = _figures(run_dir, row, timeline, context["sweep_dir"])
    for logger in loggers:
        try:
            logger.log_run(row, steps, timeline, figures=figures)
        except Exception as error:
            if logger.name == "table":
                raise
            log.warning("logger %s failed: %s: %s", logger.name, type(error).__name__, error)
            row.setdefault("logger_errors", []).append(f"{logger.name}: {error}")


def _figures(run_dir: Path, row: dict, timeline, sweep_dir) -> dict:
    """`hbp.report.run_figures`; a figure that fails is left out with one warning: figures
    never cost the run."""
    try:
        from hbp.report import run_figures

        return run_figures(run_dir, row, timeline, sweep_dir)
    except Exception as error:  # noqa: BLE001 - a figure never costs the run
        log.warning("figures left out: %s: %s", type(error).__name__, error)
        return {}


def sweep_context(cfg, run_dir: Path) -> dict:
    """The run's place for dashboards: `group` = the sweep directory relative to output_root
    (e.g. "sweeps/budget"; a single run: None), `tags` = workload=, mode=, profile=,
    `sweep_dir`."""
    tags = [f"workload={cfg.workload.name}", f"mode={cfg.mode.name}", f"profile={cfg.profile.name}"]
    if framework(cfg) != "torch":
        tags.append(f"framework={framework(cfg)}")
    sweep_dir = None
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            sweep_dir = Path(HydraConfig.get().sweep.dir)
    except ImportError:  # pragma: no cover
        pass
    if sweep_dir is None:
        return {"group": None, "tags": tags, "sweep_dir": None}
    try:
        group = str(sweep_dir.absolute().relative_to(Path(cfg.output_root).absolute()))
    except ValueError:
        group = str(sweep_dir)
    return {"group": group, "tags": tags, "sweep_dir": sweep_dir}
