"""hbp.modes: how the bench runs a workload's model for a training step.

`MODES` maps a mode name (the `mode=` choice, conf/mode/<name>.yaml) to "module:Class"; a
mode class is imported only when it is used, so `mode=naive` never imports the planner or
torch.compile. `JAX_MODES` does the same for framework=jax (hbp/modes/jax/: the mode names and
config keys are shared, the classes are JAX's). `build_mode(mode_cfg, framework)` makes a mode
from its config group: `name` picks the class, every other key is a keyword argument of its
constructor.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf

from hbp.errors import ConfigError
from hbp.modes.base import Mode

MODES: dict[str, str] = {
    "naive": "hbp.modes.naive:NaiveMode",
    "checkpoint": "hbp.modes.checkpoint:CheckpointMode",
    "tiny": "hbp.modes.tiny:TinyMode",
    "sac": "hbp.modes.sac:SACMode",
    "compile_budget": "hbp.modes.compile_budget:CompileBudgetMode",
    "library_checkpoint": "hbp.modes.library_checkpoint:LibraryCheckpointMode",
}

JAX_MODES: dict[str, str] = {
    "naive": "hbp.modes.jax.naive:JaxNaiveMode",
    "checkpoint": "hbp.modes.jax.checkpoint:JaxCheckpointMode",
    "tiny": "hbp.modes.jax.tiny:JaxTinyMode",
}
MODES_BY_FRAMEWORK = {"torch": MODES, "jax": JAX_MODES}

__all__ = ["JAX_MODES", "MODES", "MODES_BY_FRAMEWORK", "Mode", "build_mode", "mode_class"]


def mode_class(name: str, framework: str = "torch") -> type:
    """The class registered as `name` for `framework`; ConfigError naming that framework's
    modes if unknown."""
    registry = MODES_BY_FRAMEWORK[framework]
    if name not in registry:
        suffix = "" if framework == "torch" else f" with framework={framework}"
        raise ConfigError("mode", name, "one of " + ", ".join(registry) + suffix)
    module_name, class_name = registry[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _as_dict(mode_cfg) -> dict:
    if isinstance(mode_cfg, str):
        return {"name": mode_cfg}
    if isinstance(mode_cfg, DictConfig):
        return OmegaConf.to_container(mode_cfg, resolve=True)
    if isinstance(mode_cfg, Mapping):
        return dict(mode_cfg)
    raise ConfigError("mode", mode_cfg, "a mode name or a mapping with a 'name' key")


def build_mode(mode_cfg, framework: str = "torch") -> Mode:
    """A mode from its config: a name ("checkpoint") or a mapping {"name": ..., **kwargs};
    `framework` ("torch", "jax") picks the registry (MODES_BY_FRAMEWORK).

    Raises ConfigError for an unknown name (listing the registered modes) or a key the mode's
    constructor does not take (listing the ones it takes)."""
    params = _as_dict(mode_cfg)
    name = params.pop("name", None)
    cls = mode_class(name, framework)
    signature = inspect.signature(cls)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    accepted = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    for key, value in params.items():
        if not takes_any and key not in accepted:
            raise ConfigError(
                f"mode.{key}",
                value,
                f"a parameter of mode {name}: " + (", ".join(accepted) or "none"),
            )
    return cls(**params)
