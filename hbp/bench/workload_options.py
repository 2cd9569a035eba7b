"""The keyword overrides a run's config gives its workload's builder (`workload_overrides`),
shared by the torch and the JAX checks (hbp.bench.config, hbp.bench.jax_config)."""

from __future__ import annotations

from omegaconf import OmegaConf

from hbp.analysis.labels import WORKLOAD_OPTIONS

__all__ = ["MODE_WORKLOAD_OPTIONS", "workload_overrides"]

# Mode options that change how the workload is built (only passed to workloads that have the
# field, and only where the workload config leaves it null).
MODE_WORKLOAD_OPTIONS = WORKLOAD_OPTIONS


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
