"""Logger "wandb": the run as a Weights & Biases run, offline unless asked otherwise.

Offline by default: no login, no network; the wandb run directory lies inside the run's
output directory (run_dir/wandb/offline-run-*), so `wandb sync run_dir/wandb/offline-run-*`
uploads it later. `logger.wandb.mode=online` logs live for users with an account. The
environment variable WANDB_MODE, when set, wins over the config (the tests set
WANDB_MODE=disabled, which skips wandb entirely).

Logged, so that a wandb workspace charts peak against step time across modes with no extra
code: the run config; per-step metrics (one wandb step per bench step); the summary row as
run summary and as a one-row table; the plan as a table (`plan`: one row per segment, nested
ones with their depth, where the mode planned); and the figures the bench gives it as images
(`hbp.report.run_figures`: the run's memory timeline, the Pareto figure of its sweep so far). The runs of one sweep
share a group (the sweep directory, relative to output_root) and carry the tags
workload=..., mode=..., profile=... beside the configured ones. wandb starts after the
measurement, so its service process never competes with the timed steps. System stats, code
and git capture are off: the bench records its own environment and they cost start-up time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from hbp.errors import ConfigError
from hbp.telemetry.tables import TIMED_PHASE, jsonable

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

    def __init__(
        self,
        run_dir: Path,
        settings: Mapping | None = None,
        run_name: str = "",
        *,
        group: str | None = None,
        tags: list[str] | None = None,
        sweep_dir: Path | None = None,
    ):
        """`group` and `tags` are the bench's (the sweep, workload=/mode=/profile=): a
        configured `group` wins, configured `tags` are added. `sweep_dir`: where the other
        runs of the sweep are (for the Pareto image)."""
        settings = dict(settings or {})
        self.run_dir = Path(run_dir)
        self.mode = resolve_wandb_mode(settings.get("mode"))
        self.project = settings.get("project") or "hbp"
        self.entity = settings.get("entity")
        self.group = settings.get("group") or group
        self.tags = list(dict.fromkeys([*(tags or []), *(settings.get("tags") or [])]))
        self.sweep_dir = Path(sweep_dir) if sweep_dir is not None else None
        self.job_type = settings.get("job_type")
        self.run_name = run_name or self.run_dir.name
        self.run_path: Path | None = None

    @property
    def wants_figures(self) -> bool:
        """Whether `log_run` uses figures (the bench makes them only then)."""
        return self.mode != "disabled"

    def log_run(
        self,
        summary: Mapping,
        steps: pd.DataFrame,
        timeline: pd.DataFrame,
        figures: Mapping[str, Path] | None = None,
    ) -> None:
        """Log the run. `figures`: name -> PNG, logged as images (the bench makes them with
        `hbp.report.run_figures`: the memory timeline, the sweep's Pareto figure)."""
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
            for record in history_records(steps):
                run.log(jsonable(record))
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float, str, bool))}
            run.summary.update(scalars)
            table = pd.DataFrame([{k: v for k, v in scalars.items()}])
            media = {"summary_table": wandb.Table(dataframe=table)}
            plan = plan_rows(self.run_dir / PLAN_FILE)
            if plan is not None:
                media["plan"] = wandb.Table(dataframe=plan)
            for name, path in (figures or {}).items():
                media[name] = wandb.Image(str(path))
            run.log(media)
            self.run_path = Path(run.dir).parent
        finally:
            run.finish()


PLAN_FILE = "plan.json"


def plan_rows(path: Path) -> pd.DataFrame | None:
    """A plan.json as a table: one row per segment in execution order (nested segments after
    their parent, with their depth), or None when there is no plan."""
    import json

    if not Path(path).is_file():
        return None
    rows = []

    def walk(segments, depth):
        for s in segments:
            rows.append(
                {
                    "depth": depth,
                    "start": s["start"],
                    "stop": s["stop"],
                    "nodes": s["stop"] - s["start"],
                    "recompute": bool(s["recompute"]),
                    "first": s.get("first", ""),
                    "last": s.get("last", ""),
                }
            )
            walk(s.get("children", []), depth + 1)

    walk(json.loads(Path(path).read_text())["segments"], 0)
    return pd.DataFrame(rows)


def history_records(steps: pd.DataFrame) -> list[dict]:
    """The per-step rows as wandb history: numbers only; a step of another phase than timed
    (warm-up, the measured and the instrumented step) has its figures under its phase
    (`warmup/step_time_s`), so a `step_time_s` chart shows the timed steps alone."""
    phases = steps["phase"] if "phase" in steps else pd.Series(TIMED_PHASE, index=steps.index)
    numeric = steps.select_dtypes("number")
    records = []
    for phase, record in zip(phases, numeric.to_dict(orient="records")):
        if phase != TIMED_PHASE:
            record = {k if k == "step" else f"{phase}/{k}": v for k, v in record.items()}
        records.append(record)
    return records
