"""hbp.workloads: the benchmark workloads, built from code with random weights and seeded
synthetic batches: hbp's own four (gpt2, resnet, unet, synthetic_dag) and real library models
(hf: transformers GPT-2 / Llama / BERT / T5 / ViT; diffusers_unet), built from their config
classes.

    wl = hbp.workloads.build("gpt2", "small", seed=0, n_layer=6)
    batch = wl.make_batch(0)
    loss = wl.step_loss(wl.model, batch)
    loss.backward()

Each workload module defines a frozen config dataclass, a `PROFILES` table
{"tiny", "small", "medium", "large"} -> config, and `make_model(cfg)`,
`make_batch(cfg, seed)`, `loss_fn(output, batch)`, `derived_facts(cfg)`. This module resolves a
profile plus overrides into a config, builds the model under a forked RNG seeded with `seed`
(same seed -> bit-identical weights, the caller's RNG untouched) and assembles the `Workload`.
A module that wraps a library's model also sets `LIBRARY` ("transformers", "diffusers"): its
`blocks` are the library's layers, not a chain, and mode=library_checkpoint applies.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from types import ModuleType

import torch

from hbp.errors import ConfigError
from hbp.workloads.base import Batch, Workload

# hbp's own models, whose `blocks` are a chain (the checkpoint and sac modes regroup them).
OWN_WORKLOADS = ("gpt2", "resnet", "unet", "synthetic_dag")
# Libraries' models (transformers, diffusers), with their own checkpointing.
LIBRARY_WORKLOADS = ("hf", "diffusers_unet")
WORKLOADS = OWN_WORKLOADS + LIBRARY_WORKLOADS
PROFILES = ("tiny", "small", "medium", "large")

__all__ = [
    "LIBRARY_WORKLOADS",
    "OWN_WORKLOADS",
    "PROFILES",
    "WORKLOADS",
    "Batch",
    "Workload",
    "build",
    "describe",
    "resolve_config",
    "require",
]


def require(ok: bool, field: str, value, accepted: str) -> None:
    """Raise `ConfigError("workload.<field>", value, accepted)` unless `ok`."""
    if not ok:
        raise ConfigError(f"workload.{field}", value, accepted)


def build(name: str, profile: str = "small", *, seed: int = 0, **overrides) -> Workload:
    """The workload `name` at `profile`, config fields replaced by `overrides` (None = keep
    the profile's value). The model is float32, on CPU, in train mode, initialised from
    `seed` (the global RNG state is left as it was).

    Raises:
        ConfigError: unknown name ("workload"), profile ("profile"), override key or bad
            value ("workload.<key>"); the message lists the accepted values.
    """
    module, cfg = _resolve(name, profile, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = module.make_model(cfg)
    model.train()
    return Workload(
        name=name,
        profile=profile,
        model=model,
        make_batch=functools.partial(module.make_batch, cfg),
        loss_fn=module.loss_fn,
        config=_facts(module, cfg, model),
        library=getattr(module, "LIBRARY", None),
    )


def describe(name: str, profile: str = "small", **overrides) -> dict:
    """`build(...).config` without allocating the weights: the model is built on the meta
    device, so GPT-2 large's 355M parameters cost nothing. Same errors as `build`."""
    module, cfg = _resolve(name, profile, overrides)
    with torch.device("meta"):
        model = module.make_model(cfg)
    return _facts(module, cfg, model)


def resolve_config(name: str, profile: str = "small", **overrides):
    """The workload's config dataclass for `profile` with `overrides` applied and checked."""
    return _resolve(name, profile, overrides)[1]


def _resolve(name: str, profile: str, overrides: dict) -> tuple[ModuleType, typing.Any]:
    if name not in WORKLOADS:
        raise ConfigError("workload", name, "one of " + ", ".join(WORKLOADS))
    if profile not in PROFILES:
        raise ConfigError("profile", profile, "one of " + ", ".join(PROFILES))
    module = importlib.import_module(f"hbp.workloads.{name}")
    base = module.PROFILES[profile]
    hints = typing.get_type_hints(type(base))
    changes = {}
    for key, value in overrides.items():
        if key not in hints:
            raise ConfigError(f"workload.{key}", value, f"a field of {name}: " + ", ".join(hints))
        if value is not None:
            changes[key] = _coerce(key, value, hints[key])
    cfg = dataclasses.replace(base, **changes)
    cfg.validate()
    return module, cfg


def _coerce(key: str, value, hint):
    """`value` as the field's type (str, int, float, bool or tuple[int, ...]); Hydra passes
    ListConfig for lists and ints for whole floats."""
    if hint is str:
        require(isinstance(value, str), key, value, "a string")
        return value
    if hint is bool:
        require(isinstance(value, bool), key, value, "true or false")
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if hint is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        require(number, key, value, "a number")
        return float(value)
    # tuple[int, ...]
    is_seq = hasattr(value, "__iter__") and not isinstance(value, (str, bytes))
    items = list(value) if is_seq else [value]
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in items)
    require(is_seq and ints, key, value, "a list of integers")
    return tuple(items)


def _facts(module: ModuleType, cfg, model: torch.nn.Module) -> dict:
    """The flat config dict of a workload: its fields (tuples as lists), parameter count and
    bytes (tied weights counted once), block count and the module's derived facts."""
    facts = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    params = list(model.parameters())
    facts["params"] = sum(p.numel() for p in params)
    facts["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    facts["n_blocks"] = len(model.blocks)
    facts.update(module.derived_facts(cfg))
    return facts
