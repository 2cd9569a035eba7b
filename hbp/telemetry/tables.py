"""A run directory's files: metrics.json (one summary row), error.json, config.yaml and the
per-step / per-op parquet tables.

Every file is written to a temporary name in the same directory and renamed into place, so a
crash never leaves a half-written metrics.json for `hbp.analysis.collect` to trip on; the file
gets the permissions a plain `open()` would give it (0644 under the usual umask 022), so
collaborators on a shared machine can read the outputs.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Mapping
from datetime import date, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from hbp.files import atomic_write, write_text

METRICS_FILE = "metrics.json"
ERROR_FILE = "error.json"
CONFIG_FILE = "config.yaml"
STEPS_FILE = "steps.parquet"
#: The `phase` of steps.parquet's rows whose times are the run's own (`step_time_s` is their
#: median; the others: "warmup", "measured", "instrumented").
TIMED_PHASE = "timed"
TIMELINE_FILE = "memory_timeline.parquet"


def jsonable(value: Any) -> Any:
    """`value` as plain JSON types: numpy/torch scalars -> Python numbers, NaN/inf -> None,
    paths/devices/dtypes -> str, mappings and sequences recursively."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return jsonable(value.item())
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return str(value)


def write_json(path: Path, obj: Any) -> Path:
    """Write `obj` (made `jsonable`) as indented JSON, atomically."""
    text = json.dumps(jsonable(obj), indent=2, sort_keys=False) + "\n"
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_parquet(path: Path, frame: pd.DataFrame) -> Path:
    """Write `frame` to parquet (pyarrow), atomically, without the index."""
    return atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


def write_metrics(run_dir: Path, row: Mapping) -> Path:
    """The run's summary row -> run_dir/metrics.json."""
    return write_json(Path(run_dir) / METRICS_FILE, dict(row))


def write_error(run_dir: Path, error: BaseException, context: Mapping | None = None) -> Path:
    """A failed run's record -> run_dir/error.json: status, error type and message, the
    traceback as text, and `context` (workload, mode, profile, config, ...)."""
    record = {
        "status": "error",
        **dict(context or {}),
        "error_type": type(error).__name__,
        "error": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return write_json(Path(run_dir) / ERROR_FILE, record)


def write_config(run_dir: Path, config: Mapping) -> Path:
    """The resolved run config -> run_dir/config.yaml."""
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(OmegaConf.create(jsonable(config)))
    return write_text(Path(run_dir) / CONFIG_FILE, text)


def write_artifacts(run_dir: Path, artifacts: Mapping[str, Any]) -> list[Path]:
    """Write a mode's extra files: name -> content. A DataFrame goes to parquet, str to text,
    bytes as is, anything else to JSON. Names must be plain file names inside run_dir."""
    written = []
    for name, content in artifacts.items():
        path = Path(run_dir) / name
        if path.parent != Path(run_dir) or name in ("", ".", ".."):
            raise ValueError(f"artifact name {name!r} must be a plain file name")
        if isinstance(content, pd.DataFrame):
            written.append(write_parquet(path, content))
        elif isinstance(content, str):
            written.append(write_text(path, content))
        elif isinstance(content, bytes):
            written.append(atomic_write(path, lambda tmp, c=content: Path(tmp).write_bytes(c)))
        else:
            written.append(write_json(path, content))
    return written


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


class TableLogger:
    """Logger "table": the run's per-step rows and memory timeline as parquet files."""

    name = "table"
    wants_figures = False

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def log_run(
        self, summary: Mapping, steps: pd.DataFrame, timeline: pd.DataFrame, figures=None
    ) -> None:
        write_parquet(self.run_dir / STEPS_FILE, steps)
        if timeline is not None and len(timeline):  # compile_budget's step records none
            write_parquet(self.run_dir / TIMELINE_FILE, timeline)
