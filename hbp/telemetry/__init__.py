"""hbp.telemetry: what a run records and where.

Every run writes metrics.json (its summary row) and config.yaml, or error.json if it failed
(`tables`). On top of that the `logger` config group chooses:

- none: nothing more;
- table: steps.parquet (per-step rows) and memory_timeline.parquet (per-op live bytes);
- wandb: table + a wandb run, offline by default (`wandb_logger`).

Also here: environment capture (`environment`) and the psutil / pynvml samplers (`samplers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hbp.errors import ConfigError
from hbp.telemetry.tables import TableLogger

LOGGERS = ("none", "table", "wandb")


def make_loggers(logger_cfg: Mapping, run_dir: Path, run_name: str = "", **context) -> list:
    """The loggers the `logger` config asks for; each has `log_run(summary, steps, timeline)`.
    `context`: the run's place in a sweep for the wandb logger (group, tags, sweep_dir)."""
    name = logger_cfg.get("name", "none")
    if name == "none":
        return []
    if name == "table":
        return [TableLogger(run_dir)]
    if name == "wandb":
        from hbp.telemetry.wandb_logger import WandbLogger

        wandb_logger = WandbLogger(run_dir, logger_cfg.get("wandb"), run_name, **context)
        return [TableLogger(run_dir), wandb_logger]
    raise ConfigError("logger", name, "one of " + ", ".join(LOGGERS))
