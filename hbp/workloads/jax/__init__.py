"""hbp.workloads.jax: the bench's JAX workloads, written in plain JAX (no model library, no
downloads): gpt2 and synthetic_dag, the same models as their torch twins, sized by the same
config dataclasses and profiles (`hbp.workloads.resolve_config`), random weights from a seed.

    wl = hbp.workloads.jax.build("gpt2", "tiny", seed=0)
    loss = wl.loss(wl.params, *wl.batch)
    grads = jax.grad(wl.loss)(wl.params, *wl.batch)

Options the JAX models do not have are refused with a ConfigError: dropout (no RNG is
threaded through the loss) and the chunked LM head (`hbp.ops` is a torch operator).
"""

from __future__ import annotations

import importlib

import jax
import numpy as np

from hbp.workloads import require, resolve_config
from hbp.workloads.jax.base import JaxWorkload, param_facts, params_from_torch

JAX_WORKLOADS = ("gpt2", "synthetic_dag")

__all__ = ["JAX_WORKLOADS", "JaxWorkload", "build", "check", "param_facts", "params_from_torch"]


def check(name: str, profile: str = "small", **overrides):
    """The workload's config (the torch twin's dataclass, checked) after the JAX-only checks.

    Raises:
        ConfigError: an unknown name ("workload.name"), or what `resolve_config` raises, or
            an option the JAX model does not have ("workload.dropout", "workload.chunked_loss").
    """
    require_name = name in JAX_WORKLOADS
    if not require_name:
        from hbp.errors import ConfigError

        raise ConfigError(
            "workload.name", name, "one of " + ", ".join(JAX_WORKLOADS) + " with framework=jax"
        )
    cfg = resolve_config(name, profile, **overrides)
    if name == "gpt2":
        require(cfg.dropout == 0.0, "dropout", cfg.dropout, "0 with framework=jax")
        require(not cfg.chunked_loss, "chunked_loss", cfg.chunked_loss, "false with framework=jax")
    return cfg


def build(name: str, profile: str = "small", *, seed: int = 0, **overrides) -> JaxWorkload:
    """The JAX workload `name` at `profile` with config `overrides` (None = the profile's
    value): parameters and batch from two NumPy generators seeded with (seed, 0) and
    (seed, 1) (the same seed gives the same arrays; no XLA compilation)."""
    cfg = check(name, profile, **overrides)
    module = importlib.import_module(f"hbp.workloads.jax.{name}")
    params_rng, batch_rng = (np.random.default_rng([seed, k]) for k in (0, 1))
    workload = module.make_workload(cfg, profile, params_rng, batch_rng)
    workload.params = jax.device_put(workload.params)  # NumPy -> JAX arrays (no compilation)
    return workload
