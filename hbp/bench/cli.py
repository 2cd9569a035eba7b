"""Hydra glue: run.py's task function (`hydra_main`) under the error contract, and the
callback (`RunGuard`) that rejects bad input before Hydra creates any directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hbp.bench.config import check_sweep_lists, check_writable, resolve_device, validate
from hbp.bench.rundir import (
    clear_job_dir,
    default_run_dir,
    finished_run,
    legacy_run_key,
    remove_run_dir,
    run_key,
)
from hbp.bench.runner import run
from hbp.bench.summary import format_summary
from hbp.errors import BudgetError, HBPError
from hbp.telemetry.environment import capture_environment
from hbp.telemetry.tables import ERROR_FILE, METRICS_FILE, read_json, write_error

try:  # Hydra is a dependency, but `run` works without an initialised Hydra
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object

log = logging.getLogger("hbp.bench")

SKIPPED_MARK = ".skipped"  # touched in a job's directory when the job was skipped


def _fail(message: str, code: int = 2):
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def _said(error: Exception) -> str:
    """`error` as the bench's command line reads it: a BudgetError's way out names the
    library's keyword (`budget=0.43 or more plans`) and default ('50%act'); the bench's
    key is `mode.budget` and its default is "min"."""
    text = str(error)
    if isinstance(error, BudgetError):
        text = text.replace("('50%act', the default)", "('50%act')")
        text = text.replace("budget=", "mode.budget=")
    return text


def hydra_main(cfg: DictConfig) -> dict | None:
    """run.py's task function: `run(cfg)` under the error contract.

    - Bad input (ConfigError or any other hbp error, e.g. an infeasible budget) in a single
      run: "error: <field>=<value> is not accepted: expected <accepted values>" on stderr,
      exit code 2, and the run dir Hydra made is removed (nothing else was written).
    - Any other exception in a single run: error.json in the run dir, then Hydra reports the
      traceback (exit code 1).
    - In a multirun every failure writes error.json (no metrics.json) in the job's dir and the
      sweep goes on; `RunGuard` reports the failures at the end and exits non-zero.
    - In a multirun a job whose run key has a finished run in the sweep directory is skipped
      (its metrics.json is returned as is) unless `redo=true`: NOTE [ Run keys ].
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if int(os.environ.get("RANK", "0")) > 0:  # torchrun: only rank 0 writes, errors included
        return run(cfg, default_run_dir(cfg))
    run_dir = default_run_dir(cfg)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun:
        sweep_dir = HydraConfig.get().sweep.dir
        keys = (run_key(cfg), legacy_run_key(cfg))
        done = None if cfg.get("redo") else finished_run(sweep_dir, *keys)
        if done is not None:
            log.info("%s: skipped, finished in %s (redo=true reruns it)", run_dir.name, done)
            if cfg.logger.name == "wandb" and not (done / "wandb").is_dir():
                log.warning(
                    "%s: finished without logger=wandb: no wandb run is made for it "
                    "(redo=true runs it again with one)",
                    run_dir.name,
                )
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / SKIPPED_MARK).touch()
            restore_hydra_record(run_dir)
            return read_json(done / METRICS_FILE)
        clear_job_dir(run_dir, f"{HydraConfig.get().job.name}.log")  # a rerun, a retried failure
    try:
        result = run(cfg, run_dir)
        keep_hydra_record(run_dir)
        return result
    except Exception as error:
        bad_input = isinstance(error, HBPError) and not multirun
        if bad_input and remove_run_dir(run_dir, Path(cfg.output_root)):
            _fail(_said(error))
        context = {
            "workload": cfg.workload.name,
            "mode": cfg.mode.name,
            "profile": cfg.profile.name,
            "mode_budget": cfg.mode.get("budget"),  # as a finished run's metrics name it
            "run_dir": str(run_dir),
        }
        try:  # what a finished run records of itself: its key and the environment
            context["run_key"] = run_key(cfg)
            context.update(capture_environment(resolve_device(cfg.device)))
        except Exception:  # noqa: BLE001 - a config that cannot say is itself the error
            pass
        try:
            context["config"] = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # an unresolvable config is itself the error
            pass
        write_error(run_dir, error, context)
        if bad_input:  # raised after the run had written files: keep them, with error.json
            _fail(f"{_said(error)} (see {run_dir / ERROR_FILE})")
        if not multirun:
            raise
        log.error(
            "%s failed: %s: %s (see %s)",
            run_dir.name,
            type(error).__name__,
            _said(error),
            run_dir / ERROR_FILE,
        )
        return None


#: Where a finished run keeps the copy of Hydra's record of it (NOTE [ A skipped job's record ]).
FINISHED_RECORD = Path(".hydra") / "finished"


def keep_hydra_record(run_dir: Path) -> None:
    """Copy Hydra's record of the run that just finished (`.hydra/*.yaml`) aside."""
    record = run_dir / ".hydra"
    if not record.is_dir():
        return
    kept = run_dir / FINISHED_RECORD
    kept.mkdir(exist_ok=True)
    for path in record.glob("*.yaml"):
        shutil.copy2(path, kept / path.name)


def restore_hydra_record(run_dir: Path) -> None:
    """Put back Hydra's record of the finished run that a skipped job's start overwrote."""
    kept = run_dir / FINISHED_RECORD
    for path in kept.glob("*.yaml") if kept.is_dir() else ():
        shutil.copy2(path, run_dir / ".hydra" / path.name)


# NOTE [ A skipped job's record ]
# Hydra writes a job's `.hydra/{config,hydra,overrides}.yaml` before it calls the task function,
# so a rerun of a sweep that skips a finished job (same run key, same directory) had rewritten
# that run's record with the later command's overrides, beside the earlier run's metrics. A
# finished run copies its record to `.hydra/finished/`, and a skip puts it back: the directory
# says which command made its numbers. (`multirun.yaml` in the sweep directory is Hydra's
# record of the last invocation.)


class RunGuard(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks.guard`).

    on_run_start / on_multirun_start: validate the composed config and the output directory
    before Hydra creates anything; bad input -> "error: ..." on stderr, exit code 2.
    on_multirun_end: the summary table of the sweep's finished runs, how many jobs of this
    invocation ran, were skipped (finished before) and failed; if any failed, list them and
    exit with code 1. A job belongs to this invocation when its metrics.json, error.json or
    skip mark is newer than the invocation's start.
    """

    started = 0.0

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, config.hydra.sweep.dir)
        try:  # NOTE [ Sweep lists checked up front ]
            params = OmegaConf.select(config, "hydra.sweeper.params") or {}
            swept = [f"{key}={value}" for key, value in params.items()]  # a sweep config's
            check_sweep_lists(config, [*swept, *config.hydra.overrides.task])
        except HBPError as error:
            _fail(str(error))
        self.started = time.time() - 1.0  # filesystem timestamps can be coarse

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

        def now(name: str) -> list[Path]:
            paths = sorted(sweep_dir.glob(f"*/{name}"))
            return [p for p in paths if p.stat().st_mtime >= self.started]

        done = sorted(sweep_dir.glob(f"*/{METRICS_FILE}"))
        ran, skipped, failed = now(METRICS_FILE), now(SKIPPED_MARK), now(ERROR_FILE)
        if done:
            print(f"\n{len(done)} runs in {sweep_dir}:")
            print(format_summary(read_json(p) for p in done), flush=True)
        print(
            f"{len(ran)} ran, {len(skipped)} skipped (finished before; redo=true reruns them), "
            f"{len(failed)} failed",
            flush=True,
        )
        if failed:
            names = ", ".join(p.parent.name + _budget_of(p) for p in failed)
            total = len(ran) + len(skipped) + len(failed)
            _fail(f"{len(failed)} of {total} runs failed: {names} (see error.json in each)", code=1)


def _budget_of(error_file: Path) -> str:
    """The " (budget B)" of a failed run whose error.json records its mode's budget, else ""."""
    try:
        budget = json.loads(error_file.read_text()).get("mode_budget")
    except (OSError, ValueError):
        return ""
    return "" if budget is None else f" (budget {budget})"
