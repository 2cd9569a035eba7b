"""The bench's configuration: checks of the composed config (`validate`), the device, the
thread count and the workload the config asks for. Cheap and side-effect free: nothing here
builds a model or creates a directory, except `build_workload` (which builds the model).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from hbp.bench.workload_options import workload_overrides
from hbp.errors import ConfigError
from hbp.modes import MODES, build_mode
from hbp.telemetry import LOGGERS

DEVICES = ("auto", "cpu", "cuda")
FRAMEWORKS = ("torch", "jax")
MAX_AUTO_THREADS = 16


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


def _launcher():
    """The Hydra launcher's config in a multirun job, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None
        return HydraConfig.get().launcher
    except Exception:
        return None


def parallel_jobs() -> int:
    """How many jobs run at once: the parallel launcher's n_jobs in a Hydra multirun (joblib
    semantics: -1 = one per CPU), else 1."""
    launcher = _launcher()
    n_jobs = launcher.get("n_jobs") if launcher is not None else None
    if not _is_int(n_jobs) or n_jobs == 0:
        return 1
    return n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)


def launcher_cpus_per_task() -> int | None:
    """The submitit launchers' `cpus_per_task` (hydra/launcher=local, slurm) in a multirun
    job, else None."""
    launcher = _launcher()
    cpus = launcher.get("cpus_per_task") if launcher is not None else None
    return cpus if _is_int(cpus) and cpus >= 1 else None


def resolve_threads(threads, jobs: int = 1, per_job: int | None = None) -> int:
    """torch intra-op threads, so that parallel jobs do not oversubscribe the cores:
    `threads` if set; else OMP_NUM_THREADS if set (joblib sets it in its workers); else
    `per_job` (a launcher's cpus_per_task) if set; else the CPUs this process may use, at
    most MAX_AUTO_THREADS, divided among `jobs` parallel jobs."""
    if threads is not None:
        return int(threads)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if per_job is not None:
        return per_job
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, MAX_AUTO_THREADS) // max(1, jobs))


def check_writable(path) -> None:
    """ConfigError("output_root", ...) unless `path` exists as a writable directory or could be
    created (its nearest existing ancestor is a writable directory on a writable filesystem
    that takes a new directory: root passes the permission checks on /proc). Leaves nothing:
    the probe directory is removed at once."""
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
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hbp-check-", dir=ancestor))
        except OSError as err:
            why = f"cannot make a directory in {ancestor}: {err.strerror}"
    if why:
        raise ConfigError("output_root", str(path), f"a writable directory ({why})")


def build_workload(cfg, with_mode_options: bool = True):
    """The configured workload, on CPU (see `hbp.workloads.build`)."""
    from hbp.workloads import build

    overrides = workload_overrides(cfg, with_mode_options)
    return build(cfg.workload.name, cfg.profile.name, seed=cfg.seed, **overrides)


def framework(cfg) -> str:
    """The run's framework: `framework.name`, "torch" for a config without the group."""
    return str(OmegaConf.select(cfg, "framework.name", default="torch"))


def validate(cfg) -> None:
    """Reject bad input with a ConfigError naming the field and the accepted values. Cheap and
    side-effect free: builds no model, creates no directory."""
    from hbp.workloads import PROFILES, WORKLOADS, resolve_config

    def need(ok: bool, field: str, accepted: str) -> None:
        if not ok:
            raise ConfigError(field, OmegaConf.select(cfg, field), accepted)

    need(framework(cfg) in FRAMEWORKS, "framework.name", "one of " + ", ".join(FRAMEWORKS))
    need(cfg.workload.name in WORKLOADS, "workload.name", "one of " + ", ".join(WORKLOADS))
    need(cfg.profile.name in PROFILES, "profile.name", "one of " + ", ".join(PROFILES))
    need(cfg.mode.name in MODES, "mode.name", "one of " + ", ".join(MODES))
    need(cfg.logger.name in LOGGERS, "logger.name", "one of " + ", ".join(LOGGERS))
    if cfg.logger.name == "wandb":  # checked as configured, whatever WANDB_MODE says
        from hbp.telemetry.wandb_logger import WANDB_MODES

        mode = OmegaConf.select(cfg, "logger.wandb.mode")
        need(
            mode in (None, "dryrun", *WANDB_MODES),
            "logger.wandb.mode",
            "one of " + ", ".join(WANDB_MODES),
        )
    need(_is_int(cfg.steps) and cfg.steps >= 1, "steps", "an integer >= 1")
    need(_is_int(cfg.warmup) and cfg.warmup >= 0, "warmup", "an integer >= 0")
    need(_is_int(cfg.seed), "seed", "an integer")
    need(isinstance(cfg.verify, bool), "verify", "true or false")
    need(isinstance(cfg.count_naive_flops, bool), "count_naive_flops", "true or false")
    need(isinstance(cfg.get("redo", False), bool), "redo", "true or false")
    need(
        cfg.threads is None or (_is_int(cfg.threads) and cfg.threads >= 1),
        "threads",
        "null (automatic) or an integer >= 1",
    )
    if framework(cfg) == "jax":
        from hbp.bench.jax_config import check_jax_config

        check_jax_config(cfg)
        check_writable(cfg.output_root)
        return
    resolve_device(cfg.device)
    from hbp.bench.distributed import check as check_distributed

    check_distributed(cfg)
    resolve_config(cfg.workload.name, cfg.profile.name, **workload_overrides(cfg))
    build_mode(cfg.mode)
    check_writable(cfg.output_root)


def check_sweep_lists(cfg, overrides: list[str]) -> None:
    """Check every value of a multirun's sweep lists over keys (`mode.budget=0.5,abc`,
    `steps=0,3`) as a single run's config would be checked (`validate`), before the sweep
    starts: a bad value is a ConfigError naming it, not a failed job among finished ones
    (NOTE [ Sweep lists checked up front ])."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = [
        o for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()
    ]
    groups = set(OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {})
    swept_groups = {o.key_or_group for o in parsed if o.key_or_group in groups}
    base = OmegaConf.to_container(cfg, resolve=False)
    base.pop("hydra", None)
    for override in parsed:
        key = override.key_or_group
        if key in groups or key.split(".")[0] in swept_groups or key.startswith("hydra"):
            continue
        for value in override.sweep_iterator():
            one = OmegaConf.create(base)
            OmegaConf.update(one, key, value, force_add=True)
            validate(one)


# NOTE [ Sweep lists checked up front ]
# Hydra composes a multirun's config once, with the first value of each sweep list, so the
# check before the sweep saw `mode.budget=0.5` of `mode.budget=0.5,abc`: the `abc` job ran,
# wrote error.json and the sweep exited 1 after the others. Each value of a list over a key
# is checked now as its own run's config would be, and a bad one stops the command with one
# line and exit code 2 before anything is written. Lists over a config group
# (`mode=naive,tiny`) change the structure and are checked per job, as before.
