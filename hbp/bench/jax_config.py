"""framework=jax: the checks of `hbp.bench.validate` (`check_jax_config`), the device
(`resolve_jax_device`) and the workload (`build_jax_workload`). Cheap: builds no model."""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from hbp.bench.workload_options import workload_overrides
from hbp.errors import ConfigError

JAX_DEVICES = ("auto", "cpu", "cuda", "cuda:N")


def resolve_jax_device(name):
    """`auto` -> JAX's default device; `cpu`; `cuda` / `cuda:N` (ConfigError when JAX has no
    such GPU)."""
    import jax

    # JAX logs a warning for every platform plugin it cannot load (e.g. "Unable to initialize
    # backend 'tpu'") when it first looks for devices: noise on the bench's stderr.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    text = str(name)
    if text == "auto":
        return jax.devices()[0]
    if text == "cpu":
        return jax.devices("cpu")[0]
    if text == "cuda" or text.startswith("cuda:"):
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            raise ConfigError("device", text, "auto or cpu: JAX sees no GPU here") from None
        index = text.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= len(gpus)):
            raise ConfigError("device", text, f"auto, cpu, cuda or cuda:0..cuda:{len(gpus) - 1}")
        return gpus[int(index or 0)]
    raise ConfigError("device", text, "one of " + ", ".join(JAX_DEVICES))


def build_jax_workload(cfg):
    """The configured JAX workload (the workload config's fields; mode options such as
    chunked_loss do not apply to JAX)."""
    from hbp.workloads.jax import build

    overrides = workload_overrides(cfg, with_mode_options=False)
    return build(cfg.workload.name, cfg.profile.name, seed=cfg.seed, **overrides)


def check_jax_config(cfg) -> None:
    """The framework=jax checks of `validate`: workload and mode among JAX's, no
    distributed, the device, the workload's JAX-only options and the mode's parameters."""
    from hbp.modes import JAX_MODES, build_mode
    from hbp.workloads.jax import JAX_WORKLOADS, check

    def need(ok: bool, field: str, accepted: str) -> None:
        if not ok:
            raise ConfigError(field, OmegaConf.select(cfg, field), accepted)

    with_jax = " with framework=jax"
    need(
        cfg.workload.name in JAX_WORKLOADS,
        "workload.name",
        "one of " + ", ".join(JAX_WORKLOADS) + with_jax,
    )
    need(cfg.mode.name in JAX_MODES, "mode.name", "one of " + ", ".join(JAX_MODES) + with_jax)
    distributed = OmegaConf.select(cfg, "distributed.name", default="none")
    need(distributed == "none", "distributed.name", "none" + with_jax)
    resolve_jax_device(cfg.device)
    check(cfg.workload.name, cfg.profile.name, **workload_overrides(cfg, with_mode_options=False))
    build_mode(cfg.mode, framework="jax")
