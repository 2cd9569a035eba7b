"""What a capture attempt could change on the caller's model and on torch's global state,
snapshotted before the attempt and put back after it, whether it failed or not.

Tracing runs the forward's Python (on proxies or fake tensors), and that Python may change
things the user did not ask for: a library installs hooks on its first call and sets a flag
saying so (transformers' output capturing), a forward caches a value on `self`, registers a
global hook, or switches grad mode, autocast or the default dtype without switching them back
on an error. `ModelState(module)` records, for the module and every submodule, the attribute
dictionary (shallow), the *contents* of every dict or set it holds (parameters, buffers,
children, and the forward / pre / backward / state_dict hooks, which `register_*_hook`
changes in place), each parameter's `requires_grad` and `.grad`, plus torch's global module
hooks, grad mode, autocast state and default dtype. `restore()` puts all of it back and says
what had changed. (RNG state: `hbp.graph.torch.fake.rng_preserved`; buffer values:
`hbp.graph.torch.fallback.buffers_restored`.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.modules.module as module_globals
from torch import nn

__all__ = ["ForwardSideEffect", "ModelState", "same_value"]


class ForwardSideEffect(TypeError):
    """A traced forward changed the module's Python state (an attribute, a hook): a graph
    would not repeat that on later calls. On a model's first call it is usually a one-time
    set-up (NOTE [ One-time initialisation in forward ] in `hbp.graph.torch.capture`)."""


# torch.nn.modules.module's global hook registries (`register_module_forward_hook`, ...).
_GLOBAL_HOOKS = tuple(
    name
    for name in (
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
        "_global_buffer_registration_hooks",
        "_global_module_registration_hooks",
        "_global_parameter_registration_hooks",
    )
    if hasattr(module_globals, name)
)

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass
class _SubmoduleState:
    path: str
    module: nn.Module
    attributes: dict[str, Any]  # a shallow copy of `module.__dict__`
    containers: dict[str, Any]  # attribute name -> a copy of the dict / set it holds


class ModelState:
    """A snapshot of `module`'s Python state and of torch's global state (module docstring)."""

    def __init__(self, module: nn.Module):
        self.submodules = [
            _SubmoduleState(
                path,
                m,
                dict(m.__dict__),
                {k: _copy(v) for k, v in m.__dict__.items() if type(v) in _CONTAINERS},
            )
            for path, m in module.named_modules(remove_duplicate=True)
        ]
        self.parameters = [(p, p.requires_grad, p.grad) for p in module.parameters()]
        self.global_hooks = {name: dict(getattr(module_globals, name)) for name in _GLOBAL_HOOKS}
        self.grad_enabled = torch.is_grad_enabled()
        self.default_dtype = torch.get_default_dtype()
        self.autocast = {
            device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
        }
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def changes(self) -> list[str]:
        """What differs from the snapshot: qualified attribute names, `<path>.<hooks dict>`
        for a changed registry, `torch.<global>` for a global."""
        changed: list[str] = []
        for s in self.submodules:
            prefix = f"{s.path}." if s.path else ""
            now = s.module.__dict__
            for key in now.keys() | s.attributes.keys():
                before, after = s.attributes.get(key, _GONE), now.get(key, _GONE)
                if key in s.containers and after is before:
                    if not _same_contents(s.containers[key], after):
                        changed.append(prefix + key)
                elif not same_value(before, after):
                    changed.append(prefix + key)
        changed += [
            f"{p}.requires_grad/.grad"
            for p, requires_grad, grad in self.parameters
            if p.requires_grad != requires_grad or p.grad is not grad
        ]
        changed += [
            f"torch.nn.modules.module.{name}"
            for name, hooks in self.global_hooks.items()
            if not _same_contents(hooks, getattr(module_globals, name))
        ]
        if torch.is_grad_enabled() != self.grad_enabled:
            changed.append("torch.is_grad_enabled()")
        if torch.get_default_dtype() != self.default_dtype:
            changed.append("torch.get_default_dtype()")
        for device, (enabled, dtype) in self.autocast.items():
            if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) != (
                enabled,
                dtype,
            ):
                changed.append(f"torch autocast state ({device})")
        return changed

    def restore(self) -> list[str]:
        """Put everything back; return what had changed (`changes()`)."""
        changed = self.changes()
        for s in self.submodules:
            for key, saved in s.containers.items():
                held = s.attributes[key]  # the same object, refilled: others may hold it
                if not _same_contents(saved, held):
                    held.clear()
                    held.update(saved)
            s.module.__dict__.clear()
            s.module.__dict__.update(s.attributes)
        for p, requires_grad, grad in self.parameters:
            p.requires_grad_(requires_grad)
            p.grad = grad
        for name, hooks in self.global_hooks.items():
            held = getattr(module_globals, name)
            held.clear()
            held.update(hooks)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_default_dtype(self.default_dtype)
        for device, (enabled, dtype) in self.autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        return changed


_GONE = object()

# Mutable containers whose contents are snapshotted (hooks registries are OrderedDicts;
# subclasses such as diffusers' FrozenDict are someone else's, and immutable).
_CONTAINERS = (dict, OrderedDict, set)


def _copy(container: dict | set) -> dict | set:
    return set(container) if isinstance(container, set) else dict(container)


def _same_contents(saved: dict | set, now: dict | set) -> bool:
    if isinstance(saved, set):
        return saved == now
    return saved.keys() == now.keys() and all(saved[k] is now[k] for k in saved)


def same_value(before: Any, after: Any) -> bool:
    """Whether assigning `after` over `before` changed nothing (the same object, or an equal
    plain Python value: torch.export re-assigns copies of a module's plain dicts)."""
    if before is after:
        return True
    if type(before) is not type(after) or isinstance(before, (torch.Tensor, nn.Module)):
        return False
    try:
        return bool(before == after)
    except Exception:  # noqa: BLE001 - no meaningful equality
        return False
