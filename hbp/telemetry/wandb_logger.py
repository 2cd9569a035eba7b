"""Logger "wandb": the run as a Weights & Biases run, offline unless asked otherwise.

Offline by default: no login, no network; the wandb run directory lies inside the run's
output directory (run_dir/wandb/offline-run-*), so `wandb sync run_dir/wandb/offline-run-*`
uploads it later. `logger.wandb.mode=online` logs live for users with an account. The
environment variable WANDB_MODE, when set, wins over the config (the tests set
WANDB_MODE=disabled, which skips wandb entirely).

Logged: the run config, per-step metrics (one wandb step per timed bench step), the summary
row as run summary and as a one-row table. wandb starts after the measurement, so its
service process never competes with the timed steps. System stats, code and git capture are
off: the bench records its own environment and they cost start-up time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from hbp.errors import ConfigError
from hbp.telemetry.tables import jsonable

WANDB_MODES = ("offline", "online", "disabled")


def resolve_wandb_mode(configured: str | None) -> str:
    """WANDB_MODE from the environment if set, else the configured mode (default offline)."""
    mode = os.environ.get("WANDB_MODE") or configured or "offline"
    if mode == "dryrun":  # wandb's old name for offline
        mode = "offline"
    if mode not in WANDB_MODES:
        raise ConfigError("logger.wandb.mode", mode, "one of " + ", ".join(WANDB_MODES))
    return mode


class WandbLogger:
    """Writes one wandb run per bench run. `settings`: the `logger.wandb` config mapping
    (mode, project, entity, group, tags, job_type)."""

    name = "wandb"

    def __init__(self, run_dir: Path, settings: Mapping | None = None, run_name: str = ""):
        settings = dict(settings or {})
        self.run_dir = Path(run_dir)
        self.mode = resolve_wandb_mode(settings.get("mode"))
        self.project = settings.get("project") or "hbp"
        self.entity = settings.get("entity")
        self.group = settings.get("group")
        self.tags = list(settings.get("tags") or [])
        self.job_type = settings.get("job_type")
        self.run_name = run_name or self.run_dir.name
        self.run_path: Path | None = None

    def log_run(self, summary: Mapping, steps: pd.DataFrame, timeline: pd.DataFrame) -> None:
        if self.mode == "disabled":
            return
        import wandb

        config = jsonable(summary.get("config", {}))
        row = {k: v for k, v in jsonable(summary).items() if k != "config"}
        run = wandb.init(
            mode=self.mode,
            dir=str(self.run_dir),
            project=self.project,
            entity=self.entity,
            group=self.group,
            tags=self.tags,
            job_type=self.job_type,
            name=self.run_name,
            config=config,
            reinit="finish_previous",
            settings=wandb.Settings(
                silent=True,
                console="off",
                x_disable_stats=True,
                x_disable_machine_info=True,
                disable_code=True,
                disable_git=True,
                disable_job_creation=True,
                x_save_requirements=False,
            ),
        )
        try:
            numeric = steps.select_dtypes("number")
            for record in numeric.to_dict(orient="records"):
                run.log(jsonable(record))
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float, str, bool))}
            run.summary.update(scalars)
            table = pd.DataFrame([{k: v for k, v in scalars.items()}])
            run.log({"summary_table": wandb.Table(dataframe=table)})
            self.run_path = Path(run.dir).parent
        finally:
            run.finish()
