"""Run directories: where a run writes (`default_run_dir`), and undoing what Hydra created for
a run rejected before it wrote anything (`remove_run_dir`); run keys and finding a sweep's
finished runs (`run_key`, `finished_run`: see NOTE [ Run keys ]).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import datetime
from pathlib import Path

# Files Hydra writes into a run directory before the task starts.
HYDRA_FILES = (".hydra", "run.log")


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


# -- run keys: resuming a sweep ------------------------------------------------------------------
# NOTE [ Run keys ]
# A run's key is a hash of its resolved config without the keys that do not change what is
# measured or where it goes by name (`KEY_EXCLUDED`: Hydra's own node, `redo`, `output_root`,
# `plan_cache`; `mode.plan_cache` counts as null: where plans are kept changes no result).
# Two runs with the same key ran the same experiment. A sweep's job directory is named after
# the key (conf/config.yaml `hydra.sweep.subdir`: `${run_key:}`), so running a sweep again
# into the same sweep directory finds each finished job where it left it, and a job whose
# numbering shifted (more values on the command line) never lands in another job's directory.
# `finished_run` looks the key up among the sweep's metrics.json files (a metrics.json means a
# finished run: it is written last); `redo=true` reruns anyway. The default framework
# (`framework: {name: torch}`) is left out of the key, so torch runs keep the keys they had
# before the framework group existed and old sweep directories still resume.
# The logger is left out too: it says where results are written, not what is measured. With it
# in the key, the documented `run.py -m sweep=quick logger=wandb` after `run.py -m sweep=quick`
# ran every job again into the same sweep directory, and the report mixed the two sets (two
# naive rows, one taken as every ratio's denominator). A finished run found under the old key
# (the logger in it, `legacy_run_key`) is found still. To add a wandb run to a finished job:
# `redo=true`, which replaces the job's files in place (`clear_job_dir`).

KEY_EXCLUDED = ("hydra", "redo", "output_root", "plan_cache", "logger")
KEY_LENGTH = 10


def run_key(config) -> str:
    """The run key of a (resolved or resolvable) config: sha1 of its canonical JSON without
    KEY_EXCLUDED, first KEY_LENGTH hex digits. See NOTE [ Run keys ]."""
    return _key(config, KEY_EXCLUDED)


def legacy_run_key(config) -> str:
    """The key runs had while the logger was part of it (NOTE [ Run keys ])."""
    return _key(config, tuple(k for k in KEY_EXCLUDED if k != "logger"))


def _key(config, excluded: tuple[str, ...]) -> str:
    from omegaconf import DictConfig, OmegaConf

    from hbp.telemetry.tables import jsonable

    if isinstance(config, DictConfig):
        fields = {
            k: OmegaConf.to_container(config[k], resolve=True) if OmegaConf.is_config(config[k])
            else config[k]
            for k in config
            if k not in excluded
        }  # fmt: skip
    else:
        fields = {k: v for k, v in dict(config).items() if k not in excluded}
    if fields.get("framework") == {"name": "torch"}:
        del fields["framework"]
    if isinstance(fields.get("mode"), dict) and fields["mode"].get("plan_cache") is not None:
        fields["mode"] = {**fields["mode"], "plan_cache": None}  # where plans are kept
    text = json.dumps(jsonable(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:KEY_LENGTH]


def _run_key_resolver(*, _root_) -> str:
    return run_key(_root_)


def register_resolvers() -> None:
    """`${run_key:}` in configs (Hydra's sweep subdir): the key of the job's config."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("run_key"):
        OmegaConf.register_new_resolver("run_key", _run_key_resolver)


def finished_run(sweep_dir: Path, *keys: str) -> Path | None:
    """The directory of a finished run with one of the run keys `keys` directly under
    `sweep_dir` (its metrics.json has that `run_key`), or None."""
    from hbp.telemetry.tables import METRICS_FILE, read_json

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return None
    for path in sorted(sweep_dir.glob(f"*/{METRICS_FILE}")):
        try:
            if read_json(path).get("run_key") in keys:
                return path.parent
        except (OSError, ValueError):
            continue
    return None


def clear_job_dir(run_dir: Path, log_name: str) -> None:
    """Before a job runs again in its directory (`redo=true`, a retried failure): everything
    an earlier run wrote there goes (its wandb run too), but Hydra's record of this job
    (`.hydra`) and its log, which is emptied (Hydra has it open for this job already)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    for entry in run_dir.iterdir():
        if entry.name == ".hydra":
            continue
        if entry.name == log_name:
            entry.write_text("")
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
